"""Context parallelism on adopted models: what makes it train as one process, and what is refused by name.

Under ``accelerator.maybe_context_parallel`` each rank holds a chunk of every sequence (torch splits head-tail:
rank ``r`` of ``N`` holds chunks ``r`` and ``2N-1-r`` of ``2N``, or ``N`` contiguous chunks when the length does not
divide into ``2N``) and ring attention is causal only (accelerate drops the mask). While the context is open, a
pre-hook on each adopted model exchanges, in one all-gather over the CP group, what each rank's forward got, and:

- weights the loss by tokens: the chunks rarely hold the same number of valid labels (the shifted last token and
  padding are ``-100``), so the mean of the chunk means is not the sequence's; a forward with ``shift_labels`` and
  no ``num_items_in_batch`` gets the CP group's valid labels / ``cp_size`` (what the Trainer passes), so the
  average over the CP ranks (the FSDP reduce-scatter of a ``fsdp_size`` load whose group is the CP group) is one
  process's loss and gradient;
- makes position ids for the whole sequence when none are passed (the model would count from 0 in each chunk);
- refuses: ``labels`` without ``shift_labels`` (shifted after the split, each chunk's last token would predict a
  token of another chunk), position ids counted from 0 in every chunk, padding before a token whose label counts
  (left padding: it would be attended), chunks of unequal length (ring attention aborts the process), a forward with
  a key/value cache and ``generate()`` inside the context; on entering it, sliding-window or chunked-attention
  models (accelerate 1.13 does not refuse them), rows that pack several sequences (position ids restarting inside
  a row) and layouts context parallelism would train wrongly (:mod:`shardadopt.adopt.context_layouts`).

Outside the context, an evaluation forward given ``num_items_in_batch`` is refused: every CP rank then runs the whole
sequence with a count divided by ``cp_size`` (``Trainer.evaluate`` before transformers 5.25), ``cp_size`` x the loss.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardadopt import upstream
from shardadopt.adopt.record import AdoptionError, adopted
from shardadopt.parallel.topology import Topology

__all__ = ["context_parallel_group", "prepare_without_adoption", "shares_batches", "token_weighted_context"]


def _cp_enabled(accelerator: Any) -> bool:
    config = getattr(accelerator, "parallelism_config", None)
    return config is not None and config.cp_enabled and getattr(config, "cp_backend", "torch") == "torch"


_PREPARED_ATTR = "_shardadopt_cp_models"  # the sharded models prepare_without_adoption saw, on their Accelerator


def _cp_models(accelerator: Any) -> list[nn.Module]:
    """The sharded models ``accelerator`` prepared: adopted, or prepared in evaluation mode (Trainer 5.19+)."""
    state = adopted(accelerator)
    return list(state.models) if state is not None else list(getattr(accelerator, _PREPARED_ATTR, ()))


def context_parallel_group(accelerator: Any) -> dist.ProcessGroup | None:
    """The CP process group of ``accelerator`` when it runs torch's context parallelism on sharded models it
    prepared (adopted, or prepared in evaluation mode as the Trainer 5.19+ does)."""
    if not _cp_enabled(accelerator) or not _cp_models(accelerator):
        return None
    return accelerator.torch_device_mesh["cp"].get_group()


def shares_batches(accelerator: Any, layout: Topology) -> bool:
    """Whether the CP ranks of an adopted model take the same batches: under context parallelism accelerate's loader
    already splits by its own data-parallel ranks (the ranks of a CP group get the same rows), so adoption leaves it
    unsplit. A layout context parallelism would train wrongly is refused by name
    (:func:`shardadopt.adopt.context_layouts.check_layout`)."""
    if not _cp_enabled(accelerator):
        return False
    _refuse_untested_layout(accelerator, layout)
    return True


def prepare_without_adoption(accelerator: Any, model: nn.Module, layout: Topology) -> None:
    """What ``Accelerator.prepare`` does to a model under context parallelism, for the sharded model the Trainer
    (transformers 5.19+) prepares with ``prepare_model(evaluation_mode=True)``, which skips it: accelerate's
    attention hooks (the mask dropped for ``is_causal=True``; a sliding-window or chunked-attention model refused),
    after refusing the layouts not tested with context parallelism; and the model is recorded on ``accelerator`` so
    that :func:`token_weighted_context` checks its forwards as an adopted model's."""
    if not _cp_enabled(accelerator):
        return
    _refuse_untested_layout(accelerator, layout)
    upstream.attach_context_parallel_hooks(model)
    models = getattr(accelerator, _PREPARED_ATTR, None)
    if models is None:
        models = []
        setattr(accelerator, _PREPARED_ATTR, models)
    if all(m is not model for m in models):  # the checks of token_weighted_context apply to it too
        models.append(model)
    _guard_evaluation(model, accelerator.parallelism_config.cp_size)


def _refuse_untested_layouts(accelerator: Any) -> None:
    state = adopted(accelerator)
    for model in state.models:
        _refuse_untested_layout(accelerator, state.topologies[id(model)])


def _refuse_untested_layout(accelerator: Any, layout: Topology) -> None:
    from shardadopt.adopt.context_layouts import check_layout

    check_layout(accelerator.parallelism_config, layout)


_IGNORE = -100
_NONE = 2 ** 62  # "no such position" in the per-row facts the CP ranks exchange


def _global_index(rank: int, cp_size: int, length: int, load_balanced: bool) -> torch.Tensor:
    """The positions in the whole sequence of a rank's ``length`` local ones: torch splits head-tail when it
    balances the load (rank ``r`` of ``N`` holds chunks ``r`` and ``2N-1-r`` of ``2N``), in ``N`` contiguous chunks
    otherwise."""
    if not load_balanced:
        return torch.arange(rank * length, (rank + 1) * length)
    chunk = length // 2
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp_size - 1 - rank) * chunk, (2 * cp_size - rank) * chunk)])


def _row_extremes(where: torch.Tensor, index: torch.Tensor, last: bool) -> torch.Tensor:
    """Per row, the last (or first) global position where ``where`` holds; -1 (or :data:`_NONE`) where none."""
    if last:
        return torch.where(where, index, -1).amax(dim=-1)
    return torch.where(where, index, _NONE).amin(dim=-1)


def _refuse_windowed_attention(models: list[nn.Module], cp_size: int) -> None:
    """accelerate's hooks drop every layer's mask for ``is_causal=True``: a sliding-window or chunked-attention
    layer would train as full causal (accelerate 1.16 refuses such models when preparing them, 1.13 does not)."""
    for model in models:
        config = getattr(model, "config", None)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        windowed = ([t for t in layer_types if t != "full_attention"] if layer_types is not None
                    else ["sliding_attention"] * (window is not None))
        if getattr(config, "attention_chunk_size", None):
            windowed.append("chunked_attention")
        if windowed:
            raise AdoptionError(
                f"context parallelism (ParallelismConfig(cp_size={cp_size})) on {type(model).__name__}, whose "
                f"layers use {sorted(set(windowed))} (sliding_window={window}): ring attention is causal only and "
                f"accelerate drops each layer's mask, so those layers would silently train as full causal "
                f"attention. Train this model without cp_size, or use a full-attention model")


def _forward_hook(group: dist.ProcessGroup, cp_size: int):
    rank = dist.get_rank(group)
    signatures: dict[int, inspect.Signature] = {}

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        signature = signatures.setdefault(id(module), inspect.signature(module.forward))
        bound = signature.bind_partial(*args, **kwargs).arguments
        given = {**bound, **next((bound.pop(p.name, {}) for p in signature.parameters.values()
                                  if p.kind is p.VAR_KEYWORD), {})}
        if given.get("past_key_values") is not None:
            raise AdoptionError(
                "context parallelism: a forward with a key/value cache (generate()) inside maybe_context_parallel. "
                "Ring attention splits a whole sequence over the CP ranks; decoding token by token cannot be split. "
                "Call generate() outside the context (each rank then runs the whole sequence)")
        tokens = given.get("input_ids")
        tokens = given.get("inputs_embeds") if tokens is None else tokens
        if tokens is None:
            return None
        batch, length = tokens.shape[:2]
        shift_labels, mask = given.get("shift_labels"), given.get("attention_mask")
        positions = given.get("position_ids")
        if shift_labels is None and given.get("labels") is not None:
            raise AdoptionError(
                "context parallelism: labels passed without shift_labels. The model would shift each rank's "
                "chunk of the labels after the split, so the last token of a chunk predicts a token of another "
                "chunk (or nothing). Shift them before maybe_context_parallel and pass both: "
                "shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:], in buffers with labels")
        index = _global_index(rank, cp_size, length, upstream.cp_load_balanced())
        # what each rank knows, exchanged in one collective: its chunk's length, valid labels and whether its
        # position ids restart at 0; per row, the last position whose output counts and the first padding
        facts = torch.zeros(3 + 2 * batch, dtype=torch.int64)
        facts[0] = length
        if shift_labels is not None:
            facts[1] = shift_labels.ne(_IGNORE).sum()
        if positions is not None and positions.shape[-1] == length:
            facts[2] = int(bool(positions.eq(torch.arange(length, device=positions.device)).all()))
        needed = torch.full((batch,), -1, dtype=torch.int64)
        first_pad = torch.full((batch,), _NONE, dtype=torch.int64)
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            # the mask split as a buffer (the Trainer splits it) or passed whole
            mask_index = index if mask.shape[-1] == length else torch.arange(mask.shape[-1])
            first_pad = _row_extremes(mask.cpu().eq(0), mask_index, last=False)
            counted = shift_labels.ne(_IGNORE) if shift_labels is not None else mask.eq(1)
            needed = _row_extremes(counted.cpu(), index if counted.shape[-1] == length else mask_index, last=True)
        facts[3:3 + batch], facts[3 + batch:] = needed, -first_pad
        gathered = [torch.empty_like(facts) for _ in range(cp_size)]
        device = torch.device("cpu") if dist.get_backend(group) == "gloo" else tokens.device
        gathered = [g.to(device) for g in gathered]
        dist.all_gather(gathered, facts.to(device), group=group)
        facts = torch.stack([f.cpu() for f in gathered])
        _refuse_traps(facts, batch, cp_size)
        kwargs = dict(kwargs)
        names = list(signature.parameters)
        # a named parameter not given positionally, or passed on through **kwargs (a PEFT model's forward)
        takes_positions = names.index("position_ids") >= len(args) if "position_ids" in names else any(
            p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        if positions is None and takes_positions:
            # what one process counts on the whole sequence (the model would count from 0 in each chunk)
            kwargs["position_ids"] = index.to(tokens.device).expand(batch, -1)
        if shift_labels is not None and given.get("num_items_in_batch") is None:
            kwargs["num_items_in_batch"] = facts[:, 1].sum().to(torch.float32) / cp_size
        return args, kwargs

    return hook


def _refuse_traps(facts: torch.Tensor, batch: int, cp_size: int) -> None:
    """Refuse by name what the CP ranks' ``facts`` (one row per rank, see ``_forward_hook``) show would train other
    numbers than one process, on every rank alike."""
    lengths = facts[:, 0]
    if bool((lengths != lengths[0]).any()):
        total = int(lengths.sum())
        raise AdoptionError(
            f"context parallelism: a sequence of {total} positions does not split into {cp_size} equal chunks "
            f"(the ranks got {lengths.tolist()}; ring attention needs equal ones and aborts the process on unequal "
            f"ones). Pad the sequences on the right to a multiple of {2 * cp_size} (load-balanced chunks), labels "
            f"-100 on the padding: e.g. DataCollatorForLanguageModeling(..., pad_to_multiple_of={2 * cp_size})")
    if int(facts[:, 2].sum()) == cp_size:
        raise AdoptionError(
            "context parallelism: every CP rank's position_ids count from 0 in its own chunk (made after the split), "
            "so RoPE rotates each chunk as if it began the sequence. Make them for the whole sequence before "
            "maybe_context_parallel and pass them in buffers (position_ids = torch.arange(seq_len).expand(batch, "
            "-1)), or leave position_ids out and they are made for the whole sequence")
    needed = facts[:, 3:3 + batch].amax(dim=0)
    first_pad = (-facts[:, 3 + batch:]).amin(dim=0)
    bad = (needed >= first_pad).nonzero().flatten().tolist()
    if bad:
        row = bad[0]
        raise AdoptionError(
            f"context parallelism: row {row} of the batch has padding (attention_mask 0) at position "
            f"{int(first_pad[row])}, before position {int(needed[row])} whose output counts (a label that is not "
            f"-100). Ring attention is causal only and accelerate drops the mask, so the tokens after the padding "
            f"would attend to it. Pad on the right (tokenizer.padding_side = 'right') with labels -100 on the "
            f"padding, or train without cp_size")


def token_weighted_context(accelerator: Any, inner: AbstractContextManager[Any]) -> AbstractContextManager[Any]:
    """``inner`` (accelerate's ``maybe_context_parallel``) with the adopted models' losses weighted by tokens over
    the CP group while it is open; ``inner`` itself when context parallelism is off or no model was adopted.

    Args:
        accelerator: the ``Accelerator`` whose ``maybe_context_parallel`` made ``inner``.
        inner: the context manager accelerate returned.

    Returns:
        A context manager to enter in its place.

    Raises:
        AdoptionError: a layout context parallelism would train wrongly
            (:func:`shardadopt.adopt.context_layouts.check_layout`), or a sliding-window model.
    """
    group = context_parallel_group(accelerator)
    if group is None:
        return inner
    if adopted(accelerator) is not None:  # models prepared in evaluation mode were checked by prepare_without_adoption
        _refuse_untested_layouts(accelerator)
    cp_size, models = accelerator.parallelism_config.cp_size, _cp_models(accelerator)
    _refuse_windowed_attention(models, cp_size)
    for model in models:
        _guard_evaluation(model, cp_size)
    return _checked(inner, models, group, cp_size)


@contextmanager
def _checked(inner: AbstractContextManager[Any], models: list[nn.Module], group: dist.ProcessGroup,
              cp_size: int) -> Iterator[None]:
    from shardadopt.adopt.context_layouts import check_first_forward

    with inner:
        _INSIDE.update(models)
        handles = [m.register_forward_pre_hook(_forward_hook(group, cp_size), with_kwargs=True) for m in models]
        for model in models:  # after the step's checks: equal chunks, position ids for the whole sequence
            check_first_forward(model, group, cp_size)  # rows packing several sequences (adopted or Trainer 5.19+)
        generating = [m for m in models if callable(getattr(m, "generate", None)) and "generate" not in vars(m)]
        for model in generating:  # an instance attribute over the class's method while the context is open
            model.generate = _refuse_generate
        try:
            yield
        finally:
            _INSIDE.difference_update(models)
            for handle in handles:
                handle.remove()
            for model in generating:
                del model.generate


_INSIDE: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models whose maybe_context_parallel is open
_GUARDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _guard_evaluation(model: nn.Module, cp_size: int) -> None:
    """An evaluation forward outside the context on a model prepared for context parallelism, given
    ``num_items_in_batch``: the Trainer before transformers 5.25 evaluates so (each CP rank runs the whole sequence,
    but its count is divided by ``cp_size`` as for a split one), and reported ``cp_size`` x the evaluation loss."""
    if model in _GUARDED:
        return
    _GUARDED.add(model)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training or module in _INSIDE or kwargs.get("num_items_in_batch") is None:
            return
        raise AdoptionError(
            f"context parallelism (cp_size={cp_size}): an evaluation forward given num_items_in_batch outside "
            f"maybe_context_parallel. Every CP rank runs the whole sequence while the count is divided by cp_size "
            f"as for a split one, so the loss would be {cp_size} x one process's (Trainer.evaluate before "
            f"transformers 5.25, which evaluates under context parallelism). Upgrade transformers to 5.25, or "
            f"evaluate without cp_size")

    model.register_forward_pre_hook(hook, with_kwargs=True)


def _refuse_generate(*args: Any, **kwargs: Any) -> Any:
    raise AdoptionError(
        "context parallelism: generate() inside maybe_context_parallel. Ring attention splits one whole sequence "
        "over the CP ranks; decoding token by token with a key/value cache cannot be split. Call generate() "
        "outside the context (each rank then runs the whole sequence, as one process does)")
