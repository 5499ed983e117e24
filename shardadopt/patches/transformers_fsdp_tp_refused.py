"""transformers 5.16 / 5.17: refuse ``DistributedConfig(fsdp_size=N, tp_size=M)``, which they accept but cannot apply.

transformers 5.15 refuses the combination in ``DistributedConfig`` ("FSDP+TP is not supported yet"); 5.16 dropped
that check, but ``DistributedMixin.prepare_distribute_model`` and ``maybe_distribute_model``
(``transformers/distributed/mixin.py``) still apply one kind of sharding only::

    if distributed_config.tp_size > 1:
        ...
        model = apply_tensor_parallelism(model, tp_mesh)

    elif distributed_config.fsdp_size > 1:

so a 2-D request builds a ``tp_size``-rank mesh, FSDP is never applied, and on the ranks outside that mesh loading
fails with ``IndexError: list index out of range`` (``DeviceMesh.get_group``) while the others wait in collectives.
5.18 applies both (transformers 5.18 ``maybe_distribute_model``: "Both may apply"). The wrapper calls
:func:`shardadopt.loadtime.refuse_fsdp_with_tp` at the top of ``prepare_distribute_model``, before any mesh exists,
so every rank raises the same error naming the fix.
"""

from __future__ import annotations

import ast

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.probing import body_calls, if_chain, if_chains, source_tree, undecided
from shardadopt.upstream.versions import supported

MODULE = "transformers.distributed.mixin"
FSDP_APPLY = "apply_fully_sharded_data_parallelism"
TP_APPLY = "apply_tensor_parallelism"


def fsdp_with_tp(function) -> bool | None:
    """Whether ``function`` can apply FSDP and TP together: False when both are branches of one ``if`` chain (5.16 /
    5.17: ``if tp_size > 1: .. elif fsdp_size > 1: ..``), True when a statement list holds an ``if`` applying TP and,
    after it, one applying FSDP, neither chain applying the other (5.18+: "Both may apply"), None otherwise."""
    return _fsdp_with_tp(source_tree(function))


def _fsdp_with_tp(tree) -> bool | None:
    for chain in if_chains(tree):
        fsdp = [i for i, (_, body) in enumerate(chain) if body_calls(body, FSDP_APPLY)]
        tp = [i for i, (_, body) in enumerate(chain) if body_calls(body, TP_APPLY)]
        if fsdp and tp and not set(fsdp) & set(tp):
            return False
    for node in ast.walk(tree):
        for block in (getattr(node, field, None) for field in ("body", "orelse", "finalbody")):
            tp_applied = False
            for statement in block if isinstance(block, list) else ():
                if not isinstance(statement, ast.If):
                    continue
                bodies = [body for _, body in if_chain(statement)]
                applies_tp = any(body_calls(body, TP_APPLY) for body in bodies)
                applies_fsdp = any(body_calls(body, FSDP_APPLY) for body in bodies)
                if applies_fsdp and not applies_tp and tp_applied:
                    return True
                tp_applied = tp_applied or (applies_tp and not applies_fsdp)
    return None


def probe() -> Probe:
    """Build the 2-D ``DistributedConfig`` (5.15 refuses it), then parse ``maybe_distribute_model``."""
    from transformers.distributed import DistributedConfig

    try:
        DistributedConfig(fsdp_size=2, tp_size=2)
    except ValueError:
        return Probe(False, "DistributedConfig itself refuses fsdp_size with tp_size")
    where = "transformers-fsdp-tp-refused probe"
    both = fsdp_with_tp(upstream.upstream_method(Target(MODULE, "DistributedMixin.maybe_distribute_model"), where))
    if both is None:
        raise undecided("DistributedMixin.maybe_distribute_model", f"{FSDP_APPLY} and {TP_APPLY} as branches of one "
                        "if/elif (this patch's broken shape) nor TP then FSDP in separate ifs of one block "
                        "(2-D loading)")
    if both:
        return Probe(False, "maybe_distribute_model applies FSDP and TP together (2-D loading)")
    return Probe(True, "DistributedConfig accepts fsdp_size with tp_size, but maybe_distribute_model applies TP "
                       "alone: 2-D loading fails on the ranks outside the TP mesh")


def _prepare_distribute_model(wrapped, instance, args, kwargs):
    from transformers import __version__

    from shardadopt.loadtime import refuse_fsdp_with_tp

    refuse_fsdp_with_tp(args[0] if args else kwargs.get("distributed_config"), __version__)
    return wrapped(*args, **kwargs)


PATCH = Patch(
    id="transformers-fsdp-tp-refused",
    summary="fsdp_size with tp_size (2-D) raises a clear error where transformers accepts it but applies TP alone",
    upstream="fixed by 2-D loading in transformers 5.18 (maybe_distribute_model applies TP then FSDP)",
    requires=supported("transformers"),
    wrappers={Target(MODULE, "DistributedMixin.prepare_distribute_model"): _prepare_distribute_model},
    probe=probe,
)
