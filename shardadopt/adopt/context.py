"""Context parallelism on adopted models: the loss weighted by tokens across the CP group, and what is refused.

Under ``accelerator.maybe_context_parallel`` each rank holds a chunk of every sequence and the model's loss is the
mean over its own chunk's valid tokens; the gradients are then averaged over the CP ranks (the FSDP reduce-scatter
of a ``fsdp_size`` load whose group is the CP group). The chunks rarely hold the same number of valid tokens (the
shifted last token is ``-100``, and so is padding): the mean of the chunk means is not the mean over the sequence,
and training differs from one process. While the context is open, each forward of an adopted model that gets
``shift_labels`` and no ``num_items_in_batch`` is given ``num_items_in_batch`` = the valid tokens of the whole CP
group / ``cp_size`` (what the Trainer passes), so each rank's loss is ``cp_size`` x its share of the sequence's
summed loss and the average over the CP ranks is one process's loss and gradient. ``labels`` without
``shift_labels`` (shifted after the split: each chunk's last token would predict a token of another chunk) and
layouts not yet tested with context parallelism (``tp_size``, ``ep_size``) are refused by name.
"""

from __future__ import annotations

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


def context_parallel_group(accelerator: Any) -> dist.ProcessGroup | None:
    """The CP process group of ``accelerator`` when it runs torch's context parallelism on models it adopted."""
    if not _cp_enabled(accelerator) or adopted(accelerator) is None:
        return None
    return accelerator.torch_device_mesh["cp"].get_group()


def shares_batches(accelerator: Any, layout: Topology) -> bool:
    """Whether the data-parallel ranks of an adopted model are all ranks of one CP group, which must all get the
    same batch (``fsdp_size=N`` with ``cp_size=N``): adoption then leaves accelerate's loader unsplit (accelerate
    splits by its data-parallel size, 1). Other layouts with context parallelism are refused by name."""
    if not _cp_enabled(accelerator) or layout.dp_size == 1:
        return False
    cp_size = accelerator.parallelism_config.cp_size
    if layout.dp_size != cp_size:
        raise AdoptionError(
            f"context parallelism (ParallelismConfig(cp_size={cp_size})) on a model with {layout.dp_size} "
            f"data-parallel ranks is supported only when the CP group is the whole FSDP group (load with "
            f"DistributedConfig(fsdp_size={cp_size}) on {cp_size} processes); data parallelism beside context "
            f"parallelism is not tested yet")
    return True


def prepare_without_adoption(accelerator: Any, model: nn.Module, layout: Topology) -> None:
    """What ``Accelerator.prepare`` does to a model under context parallelism, for the sharded model the Trainer
    (transformers 5.19+) prepares with ``prepare_model(evaluation_mode=True)``, which skips it: accelerate's
    attention hooks (the mask dropped for ``is_causal=True``; a sliding-window or chunked-attention model refused),
    after refusing the layouts not tested with context parallelism."""
    if not _cp_enabled(accelerator):
        return
    _refuse_untested_layout(accelerator, layout)
    upstream.attach_context_parallel_hooks(model)


def _refuse_untested_layouts(accelerator: Any) -> None:
    state = adopted(accelerator)
    for model in state.models:
        _refuse_untested_layout(accelerator, state.topologies[id(model)])


def _refuse_untested_layout(accelerator: Any, layout: Topology) -> None:
    others = {name: size for name, size in (("tp_size", layout.tp_size), ("ep_size", layout.ep_size)) if size > 1}
    if others:
        spelled = ", ".join(f"{name}={size}" for name, size in others.items())
        raise AdoptionError(
            f"context parallelism (ParallelismConfig(cp_size={accelerator.parallelism_config.cp_size})) on a "
            f"model loaded with DistributedConfig({spelled}) is not supported yet (untested: heads split by "
            f"TP / experts by EP with the sequence split by CP); load with fsdp_size only, or train without "
            f"cp_size")


def _weighting_hook(group: dist.ProcessGroup, cp_size: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if kwargs.get("num_items_in_batch") is not None:
            return None
        shift_labels = kwargs.get("shift_labels")
        if shift_labels is None:
            if kwargs.get("labels") is not None:
                raise AdoptionError(
                    "context parallelism: labels passed without shift_labels. The model would shift each rank's "
                    "chunk of the labels after the split, so the last token of a chunk predicts a token of another "
                    "chunk (or nothing). Shift them before maybe_context_parallel and pass both: "
                    "shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:], in buffers with labels")
            return None
        valid = shift_labels.ne(-100).sum().to(torch.float32)
        dist.all_reduce(valid, group=group)
        return args, {**kwargs, "num_items_in_batch": valid / cp_size}

    return hook


def token_weighted_context(accelerator: Any, inner: AbstractContextManager[Any]) -> AbstractContextManager[Any]:
    """``inner`` (accelerate's ``maybe_context_parallel``) with the adopted models' losses weighted by tokens over
    the CP group while it is open; ``inner`` itself when context parallelism is off or no model was adopted.

    Args:
        accelerator: the ``Accelerator`` whose ``maybe_context_parallel`` made ``inner``.
        inner: the context manager accelerate returned.

    Returns:
        A context manager to enter in its place.

    Raises:
        AdoptionError: an adopted model is tensor- or expert-parallel (not tested with context parallelism yet).
    """
    group = context_parallel_group(accelerator)
    if group is None:
        return inner
    _refuse_untested_layouts(accelerator)
    return _weighted(inner, adopted(accelerator).models, group, accelerator.parallelism_config.cp_size)


@contextmanager
def _weighted(inner: AbstractContextManager[Any], models: list[nn.Module], group: dist.ProcessGroup,
              cp_size: int) -> Iterator[None]:
    with inner:
        handles = [m.register_forward_pre_hook(_weighting_hook(group, cp_size), with_kwargs=True) for m in models]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
