"""peft's private names. Checked on peft 0.21.2 and 0.22.0."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardadopt.upstream.base import Target, module_attribute

# ``LoraLayer._get_in_out_features(base_layer)``: the (in, out) features peft sizes LoRA factors by, which
# ``peft-sharded-adapters`` replaces (global shapes for DTensor bases). Checked on peft 0.21.2.
PEFT_LORA_IN_OUT_FEATURES = Target("peft.tuners.lora.layer", "LoraLayer._get_in_out_features")

# The attribute peft 0.22 stamps on a base layer with its transformers TP plan (``lora/model.py``,
# ``_create_and_replace``), which gates its local-shard sizing in ``_get_in_out_features``: the
# ``peft-sharded-adapters`` probe reads it there. Absent from peft 0.21.2's sizing.
PEFT_TP_PLAN_ATTRIBUTE = "_hf_tp_plan"


def peft_in_out_features() -> Callable[..., Any]:
    """``peft.tuners.tuners_utils._get_in_out_features``: the function peft's tuner layers size themselves with,
    which the ``peft-sharded-adapters`` probe reads. Checked on peft 0.21.2 and 0.22.0."""
    return module_attribute("peft.tuners.tuners_utils", "_get_in_out_features", "peft_in_out_features", "peft")
