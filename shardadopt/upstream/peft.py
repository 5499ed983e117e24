"""peft's private names. Checked on peft 0.21.2."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardadopt.upstream.base import Target, _module_attribute

# ``LoraLayer._get_in_out_features(base_layer)``: the (in, out) features peft sizes LoRA factors by, which
# ``peft-sharded-adapters`` replaces (global shapes for DTensor bases). Checked on peft 0.21.2.
PEFT_LORA_IN_OUT_FEATURES = Target("peft.tuners.lora.layer", "LoraLayer._get_in_out_features")


def peft_in_out_features() -> Callable[..., Any]:
    """``peft.tuners.tuners_utils._get_in_out_features``: the function peft's tuner layers size themselves with,
    which the ``peft-sharded-adapters`` probe reads. Checked on peft 0.21.2."""
    return _module_attribute("peft.tuners.tuners_utils", "_get_in_out_features", "peft_in_out_features", "peft")
