"""DoRA (``use_dora=True``) on a tensor-parallel base: the magnitude laid out like the output features, the weight
norm computed from this rank's shards.

The initial magnitude is the norm of the whole base weight plus rank 0's B @ A (``shapes.whole_weight``, then
broadcast from rank 0 like the factors). On a colwise base the magnitude is sharded like the output features and the
norm taken over this rank's rows; on a rowwise base it stays whole and the squared norm is summed over the TP group
(on fsdp x tp: on FSDP's unsharded TP shard). On FSDP and HSDP nothing changes: peft's forward runs inside FSDP's,
on the unsharded weight.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def lay_out_dora(dora: nn.Module, style: str, mesh: Any) -> None:
    """Lay out peft's ``DoraLinearLayer`` ``dora`` (its magnitude identical on every rank, one entry per output
    feature) on a ``style`` ("colwise"/"rowwise") base on the TP ``mesh``: shard the magnitude on a colwise base and
    route its forward through :func:`_tensor_parallel_dora`."""
    from torch.distributed.tensor import Shard, distribute_tensor

    if style == "colwise":
        magnitude = dora.weight
        dora.weight = nn.Parameter(distribute_tensor(magnitude.data, mesh, [Shard(0)], src_data_rank=None),
                                   requires_grad=magnitude.requires_grad)
    dora.forward = functools.partial(_tensor_parallel_dora, dora, style, mesh.get_group())


def _local_tensor(tensor: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensor_parallel_dora(dora: nn.Module, style: str, tp_group: Any, x: torch.Tensor, *, lora_A: nn.Module,
                          lora_B: nn.Module, scaling: float, base_layer: nn.Module,
                          base_result: torch.Tensor | None = None, adapter_name: str = "default") -> torch.Tensor:
    """peft's ``DoraLinearLayer.forward`` on a TP base, on this rank's shards: the weight norm runs over the input
    dim of W + scaling * B @ A, whole rows on a colwise base (this rank's output features), partial sums of squares
    added over the TP group on a rowwise one; like peft, the norm is detached (DoRA paper, section 4.3)."""
    weight = _local_tensor(base_layer.weight).to(x.dtype)
    with torch.no_grad():
        combined = weight + scaling * (_local_tensor(lora_B.weight) @ _local_tensor(lora_A.weight)).to(x.dtype)
        if style == "colwise":
            norm = torch.linalg.norm(combined, dim=1)
        else:
            squares = combined.pow(2).sum(dim=1)
            dist.all_reduce(squares, group=tp_group)
            norm = squares.sqrt()
    scale = (_local_tensor(dora.weight) / norm).view(1, -1)
    if base_result is None:  # lora_dropout in training: peft passes the dropped-out input, the base reruns on it
        base_result = base_layer(x)
    bias = getattr(base_layer, "bias", None)
    if bias is not None:  # on this rank's output features (colwise) or all of them (rowwise: replicated)
        base_result = base_result - _local_tensor(bias)
    return (scale - 1) * base_result + scale * lora_B(lora_A(x)) * scaling
