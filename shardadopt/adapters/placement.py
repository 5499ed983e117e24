"""LoRA factors placed like their base layer, with transformers' own TP styles (as peft's DTensor TP, peft #3079, and
torchtitan's ``components/lora.py`` do).

Each whole factor is first made global rank 0's value on every rank, so the ranks agree whatever their RNG holds and,
with rank 0 seeded like the one-process run, the adapter equals the one-process adapter. Then the factor facing the
sharded dim is sharded: colwise base (weight ``Shard(0)`` on the tp mesh) -> ``lora_A`` replicated, ``lora_B``
colwise; rowwise base (``Shard(1)``) -> ``lora_A`` rowwise (its partial output all-reduced), ``lora_B`` replicated.
Bases that are not tensor parallel (FSDP only, HSDP, EP's attention) keep both factors whole.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def set_from_rank0(param: nn.Parameter) -> None:
    """Make the whole (not yet sharded) ``param`` global rank 0's value on every rank (collective)."""
    with torch.no_grad():
        dist.broadcast(param.data, src=0)


def tp_mesh(weight: Any) -> Any:
    """The tensor-parallel (sub-)mesh a sharded base ``weight`` lives on."""
    mesh = weight.device_mesh
    return mesh["tp"] if mesh.ndim > 1 else mesh


def shard_factor(factor: nn.Module, style: str, mesh: Any) -> None:
    """Shard the whole, identical-on-every-rank ``factor`` like its base layer and install transformers' own TP
    forward for ``style`` ("colwise" or "rowwise") on it: each rank keeps its slice of the global shape."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    tp_style = ALL_PARALLEL_STYLES[style]
    for name, _ in list(factor.named_parameters(recurse=False)):
        tp_style.shard_param(factor, name, mesh)
    tp_style.install_forward(factor, mesh)
