"""PEFT LoRA adapters on models sharded at load time: laid out like their base layers, trained like one process.

peft adds LoRA factors as plain tensors (and, on tensor-parallel loads, sizes them by the local shard); nothing
reduces their gradients over the data-parallel ranks, so each rank trains its own adapter (FSDP), or the first
forward crashes (TP, fsdp x tp, EP). :func:`lay_out_adapters` (``layout``) fixes an injected adapter: sized by the
global shape (``shapes``), rank 0's values placed like the base layer (``placement``, ``dora``), gradients averaged
over the data-parallel ranks (``data_parallel``), ``modules_to_save`` copies whole (``modules_to_save``), exported
whole (``export``), or refused by name (``refusals``). The design and its rules: ``docs/adapters.md``.

``lay_out_adapters``, ``adapter_state_dict``, ``full_adapter_tensors``, ``whole_copy``, ``whole_weight`` and
``average_gradients`` are collectives: call them on every rank.
"""

from shardadopt.adapters.data_parallel import average_gradients
from shardadopt.adapters.export import adapter_state_dict, full_adapter_tensors
from shardadopt.adapters.layout import check_adapters, lay_out_adapters
from shardadopt.adapters.modules_to_save import whole_copy
from shardadopt.adapters.peft_layers import adapter_parameters, is_sharded_base
from shardadopt.adapters.refusals import (
    MERGE_REFUSAL,
    WEIGHTED_REFUSAL,
    AdapterLayoutError,
    check_config,
    dtensor_tensor_parallel,
    refuse_weighted_adapter,
)
from shardadopt.adapters.shapes import global_adapter_shapes, whole_weight

__all__ = ["AdapterLayoutError", "lay_out_adapters", "check_config", "check_adapters",
           "global_adapter_shapes", "adapter_state_dict", "full_adapter_tensors", "is_sharded_base",
           "dtensor_tensor_parallel", "whole_copy", "whole_weight", "MERGE_REFUSAL", "WEIGHTED_REFUSAL",
           "refuse_weighted_adapter", "adapter_parameters", "average_gradients"]
