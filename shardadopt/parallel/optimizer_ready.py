"""Put a model sharded at load time into the state an optimizer must be built from.

Two upstream states make an optimizer built from ``model.parameters()`` silently wrong:

- after a forward outside training (an evaluation), FSDP2 groups built with ``reshard_after_forward=False`` (the
  final norm and LM head) still expose their unsharded plain parameters: the optimizer would step copies that
  FSDP discards, and those weights never train (:func:`reshard_fsdp_modules`);
- transformers 5.15's tensor parallelism keeps row-parallel shards as plain, non-contiguous views into the full
  loaded weight (which stays alive behind them); torch's fused AdamW on CPU mis-updates non-contiguous parameters
  (each step off by up to 2x the learning rate; torch 2.13-2.15,
  :func:`shardadopt.upstream.torchprobe.fused_adamw_strided_ok`) (:func:`make_shards_contiguous`).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["prepare_for_optimizer", "reshard_fsdp_modules", "make_shards_contiguous"]


def reshard_fsdp_modules(model: nn.Module) -> int:
    """Put every FSDP2 module of ``model`` back in its sharded state; returns how many there are."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.reshard()
    return len(modules)


def make_shards_contiguous(model: nn.Module) -> list[str]:
    """Give each non-contiguous plain parameter its own contiguous storage (same ``Parameter`` object, so call it
    before building the optimizer); returns their names. DTensor parameters are left alone."""
    from torch.distributed.tensor import DTensor

    changed = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not isinstance(param, DTensor) and not param.is_contiguous():
                param.data = param.data.contiguous()
                changed.append(name)
    return changed


def prepare_for_optimizer(model: nn.Module) -> None:
    """Both of the above: what ``Trainer.create_optimizer`` needs on a model sharded at load time."""
    reshard_fsdp_modules(model)
    make_shards_contiguous(model)
