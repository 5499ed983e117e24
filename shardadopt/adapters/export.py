"""Adapters exported whole from a sharded model: PEFT's format, as one process writes it.

With the patch, ``PeftModel.save_pretrained(dir)`` on a sharded model writes these full tensors once (global rank 0,
under a fence, then a barrier); the result loads with ``PeftModel.from_pretrained`` in one process or onto a sharded
base. Merging is refused on sharded models (``refusals.MERGE_REFUSAL``): export, then merge in one process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardadopt.adapters.shapes import whole_tensor


def full_adapter_tensors(model: nn.Module) -> dict[str, Any]:
    """What ``PeftModel.save_pretrained(state_dict=...)`` filters on a sharded model. Collective.

    Args:
        model: the peft model.

    Returns:
        ``model.state_dict()`` with every LoRA factor as its full tensor (the sharded base weights as they are:
        nothing of them is gathered).
    """
    return {k: whole_tensor(v) if "lora_" in k else v for k, v in model.state_dict().items()}


def adapter_state_dict(model: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The full tensors of one adapter in PEFT's format, on every rank. Collective for sharded models.

    Args:
        model: the peft model.
        adapter_name: the adapter to export.

    Returns:
        Keys as ``save_pretrained`` writes them, each a full tensor (a copy).
    """
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(
        model, state_dict=full_adapter_tensors(model), adapter_name=adapter_name).items()}
