"""FSDP units for the repeated blocks that a model's FSDP plan names wrongly (the vision towers of VLMs).

transformers builds a model's FSDP plan from ``config.base_model_fsdp_plan``, which every config inherits as
``{"embed_tokens", "layers.*", "norm"}`` unless its class declares one. A vision tower (Qwen2.5-VL's ``blocks``,
SigLIP's ``encoder.layers``) has none of those names, so the rules meant for its blocks match nothing: the blocks
are no FSDP unit of their own, stay in the root unit and are gathered whole at every forward.

:func:`complete_fsdp_plan` runs on a model about to be sharded with FSDP: where rules of its plan match nothing
and the model has lists of repeated blocks (a ``ModuleList`` of one class whose items are, or hold, the classes
its ``_no_split_modules`` names: what accelerate's FSDP auto-wrap and ``device_map`` keep whole) that no rule
covers, each such list becomes ``"<list>.*": "free_full_weight"`` and the rules that match nothing are dropped
(they were meant for those blocks; transformers warns about each). A plan whose rules all match, or a model
without such lists, stays as it is.

:func:`gathered_for_call` covers a call into a model that runs no forward of the FSDP units enclosing it:
transformers 5.25's ``generate`` encodes the images itself before the prefill (``base_model.get_image_features``),
so FSDP2's pre-forward hooks never gather the root unit (a vision tower's patch embedding, a projector) and the
first layer meets DTensor shards. It unshards those units for the call and reshards them after; units the call
runs a forward of (the tower's blocks) gather themselves as in any forward.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from shardadopt import upstream

FREE_FULL_WEIGHT = "free_full_weight"


def wildcard(name: str) -> str:
    """``name`` with each layer number between dots (or at the end) as ``*``: how plan rules name list items."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def _names(model: Any) -> set[str]:
    """Every module and parameter name of ``model``, as it is and with layer numbers as ``*``."""
    names = set()
    for name, _ in [*model.named_modules(), *model.named_parameters()]:
        names.update((name, wildcard(name)))
    return names


def unmatched_rules(model: Any, plan: dict[str, str]) -> list[str]:
    """The rules of ``plan`` that name no module or parameter of ``model``."""
    names = _names(model)
    return [rule for rule in plan if rule not in names]


def block_lists(model: Any, block_classes: Iterable[str]) -> list[str]:
    """The ``ModuleList``\\s of ``model`` (outermost first) of repeated blocks: items all of one class, each a
    module of a class in ``block_classes`` or holding one (SigLIP-like towers name their attention class, not
    their encoder layer, in ``_no_split_modules``)."""
    import torch

    classes = set(block_classes)
    found: list[str] = []
    for name, module in model.named_modules():
        if (isinstance(module, torch.nn.ModuleList) and len(module) > 0
                and len({type(item) for item in module}) == 1
                and all(any(type(inner).__name__ in classes for inner in item.modules()) for item in module)
                and not any(name.startswith(outer + ".") for outer in found)):
            found.append(name)
    return found


def no_split_classes(model: Any) -> set[str]:
    """The block classes ``model`` and each transformers model inside it name in ``_no_split_modules``."""
    classes: set[str] = set()
    for module in model.modules():
        classes.update(upstream.model_no_split_modules(module) or ())
    return classes


def _covered(name: str, rules: Iterable[str]) -> bool:
    """Whether a rule names module ``name``, one of its items, or a module it lies in (the root aside)."""
    parts = name.split(".")
    enclosing = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    patterns = {wildcard(e) for e in enclosing}
    return any(rule in enclosing or wildcard(rule) in patterns or rule.startswith(name + ".") for rule in rules)


def block_units(model: Any, plan: dict[str, str]) -> tuple[dict[str, str], list[str]] | None:
    """The rules to add to ``plan`` (``"<list>.*"`` for each uncovered block list) and the rules to drop (those
    that match nothing), or None when ``plan`` needs nothing: its rules all match, or ``model`` has no block
    lists for them."""
    if not plan:
        return None
    unmatched = unmatched_rules(model, plan)
    if not unmatched:
        return None
    lists = block_lists(model, no_split_classes(model))
    if not lists:
        return None
    matched = [rule for rule in plan if rule not in unmatched]
    added = {f"{name}.*": FREE_FULL_WEIGHT for name in lists if not _covered(name, matched)}
    return added, unmatched


def complete_fsdp_plan(model: Any) -> dict[str, str] | None:
    """Give ``model``'s FSDP plan (``model.fsdp_plan``, edited in place) a unit per block of each repeated-block
    list its rules were meant for but miss (see the module docstring). Returns the rules added, or None when the
    plan was left as it was.

    Args:
        model: a transformers model whose plans transformers has just set (``init_parallel_plans``).

    Returns:
        The added rules (``{"visual.blocks.*": "free_full_weight"}``), ``{}`` when only rules that matched nothing
        were dropped, or None.
    """
    plan = getattr(model, "fsdp_plan", None)
    if not isinstance(plan, dict):
        return None
    change = block_units(model, plan)
    if change is None:
        return None
    added, dropped = change
    for rule in dropped:
        del plan[rule]
    plan.update(added)
    return added


def enclosing_units(model: Any, entry: Any) -> list[Any]:
    """The FSDP2 units (``FSDPModule``\\s) of ``model`` that enclose its submodule ``entry`` (``model`` and
    ``entry`` included), outermost first: the units a call into ``entry``'s methods reads without running their
    forward. Empty where ``entry`` is not in ``model`` or nothing on the way is sharded."""
    from torch.distributed.fsdp import FSDPModule

    name = next((n for n, m in model.named_modules() if m is entry), None)
    if name is None:
        return []
    parts = name.split(".") if name else []
    path = [model.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]
    return [module for module in path if isinstance(module, FSDPModule)]


@contextmanager
def gathered_for_call(model: Any, entry: Any) -> Iterator[None]:
    """Unshard the FSDP units of ``model`` that enclose ``entry`` (:func:`enclosing_units`) for the duration of a
    call into ``entry`` that is no forward of theirs, and reshard them after (also when the call raises), so the
    call reads whole parameters and their memory is freed again. Nothing happens for a model without FSDP units.

    FSDP2 picks its root at the first forward it sees (lazy initialisation): a unit inside the call (a vision
    block) must not take that role, so the outermost unit is initialised as the root first, as its own forward
    would.

    Args:
        model: the model the call was made on (transformers shards it with ``fully_shard`` at load: the root).
        entry: the submodule whose method is called (``model.base_model`` for ``get_image_features``).
    """
    units = enclosing_units(model, entry)
    if not units:
        yield
        return
    upstream.fsdp_lazy_init(units[0])
    gathered = []
    try:
        for unit in units:
            unit.unshard()
            gathered.append(unit)
        yield
    finally:
        for unit in reversed(gathered):
            unit.reshard()
