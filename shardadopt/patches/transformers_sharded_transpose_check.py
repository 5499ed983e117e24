"""A layout check on a sharded load compares this rank's slice with the shard's shape, not the parameter's global one.

Upstream: not reported yet (proposal, ``upstream-fixes/transformers-sharded-transpose-check.diff``). Qwen3-VL-MoE
checkpoints exist in two layouts of the stacked experts (the original release's ``gate_up_proj`` ``[experts,
hidden, 2 * intermediate]``, and transformers 5's own ``[experts, 2 * intermediate, hidden]``, which
``save_pretrained`` writes), so its conversion mapping transposes dims 1 and 2 only where the checkpoint tensor's
shape is not the parameter's (``Transpose(1, 2, check_dims=True)``). At a sharded load (``fsdp_size``, ``ep_size``)
the loader hands the conversion this rank's slice (``[experts / 2, ...]``), and ``Transpose.convert`` compares it
with ``model.get_parameter(name).shape``, the global shape: never equal, so a slice already in the model's layout
is transposed. ``down_proj`` then mismatches and the load raises; ``gate_up_proj`` with ``hidden == 2 *
intermediate`` is transposed silently. Found by ``tools/arch_sweep.py --task image-text-to-text``
(``qwen3_vl_moe`` on fsdp and ep).

A slice whose shape is this rank's shard shape (:func:`shardadopt.loadtime.in_shard_layout`) is kept as it is;
anything else goes through upstream's check, so the layout is decided as one process decides it on the whole
tensor. The probe reads ``Transpose.convert``: a check of the tensor's shape against the parameter's shape alone
means ``needed``, one that reads the local shard's shape means the fix is upstream.
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Any

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.versions import supported

MODULE = "transformers.core_model_loading"
# the WeightConverter whose operations run now: transformers 5.15 keeps its tensor-parallel layer there
_CONVERTER: contextvars.ContextVar[Any] = contextvars.ContextVar("shardadopt_weight_converter", default=None)


def probe() -> Probe:
    import importlib

    from shardadopt.upstream.probing import calls, names, source_tree, undecided, upstream_function

    module = importlib.import_module(MODULE)
    where = f"{MODULE}.Transpose.convert"
    tree = source_tree(upstream_function(upstream_function(module, "Transpose", where), "convert", where))
    read = names(tree)
    if "check_dims" in read and read & upstream.LOCAL_SHARD_READERS:
        return Probe(False, "Transpose.convert compares a sharded load's slice with the shard's shape")
    if "check_dims" in read and calls(tree, "get_parameter") and "shape" in read:
        return Probe(True, "Transpose(check_dims=True) compares this rank's slice of a sharded load with the "
                           "parameter's global shape: a slice already in the model's layout is transposed "
                           "(qwen3_vl_moe experts on fsdp/ep: down_proj mismatches, a square gate_up_proj silently)")
    raise undecided(where, "a check_dims shape check against the parameter's global shape (the gap) nor one "
                           "against its local shard (a fix)")


def _converter_convert(wrapped, instance, args, kwargs):
    token = _CONVERTER.set(instance)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _CONVERTER.reset(token)


def _transpose_convert(wrapped, instance, args, kwargs):
    import torch

    from shardadopt.loadtime import in_shard_layout, shard_shape

    if not getattr(instance, "check_dims", False):
        return wrapped(*args, **kwargs)
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    extra = bound.arguments.get("kwargs", {})
    model, name = extra.get("model"), extra.get("full_layer_name")
    input_dict = bound.arguments["input_dict"]
    tensors = next(iter(input_dict.values()), None) if isinstance(input_dict, dict) else None
    tensor = tensors[0] if isinstance(tensors, list) and tensors else tensors
    if model is None or name is None or not isinstance(tensor, torch.Tensor):
        return wrapped(*args, **kwargs)
    param = model.get_parameter(name)
    layer = getattr(_CONVERTER.get(), "distributed_operation", None)  # 5.15's tensor-parallel layer
    if in_shard_layout(tuple(tensor.shape), tuple(param.shape), shard_shape(param, layer)):
        target = instance.get_target_pattern(input_dict, bound.arguments["source_patterns"],
                                             bound.arguments["target_patterns"])
        return {target: tensor}
    return wrapped(*args, **kwargs)


PATCH = Patch(
    id="transformers-sharded-transpose-check",
    summary="a sharded load's layout check (Transpose(check_dims=True): qwen3_vl_moe's stacked experts) compares "
            "this rank's slice with the shard's shape (it compared it with the global shape and transposed a slice "
            "already in the model's layout: down_proj mismatched and the load raised on fsdp/ep, a square "
            "gate_up_proj was transposed silently)",
    upstream="proposal for transformers main (not reported yet)",
    requires=supported("transformers"),
    wrappers={Target(MODULE, "WeightConverter.convert"): _converter_convert,
              Target(MODULE, "Transpose.convert"): _transpose_convert},
    probe=probe,
)
