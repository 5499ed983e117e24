"""Loading a fused checkpoint tensor into sharded parameters: convert it whole, then shard each result.

Upstream: not reported yet (proposal, ``upstream-fixes/transformers-fused-weight-sharding@*.diff``). transformers'
weight
conversions turn one checkpoint tensor into several parameters (``WeightConverter`` with ``Chunk``: HRM stores each
attention's gate/q/k/v as one ``attn.gqkv_proj`` and its MLP's ``gate_up_proj``). When the model is sharded at load
time, ``convert_and_load_state_dict_in_model`` slices every checkpoint tensor with the layout of the conversion's
*first* target (``DtensorShardOperation(empty_param)``, or 5.15's tensor-parallel layer) before converting it: the
fused ``[4h, d]`` tensor is cut into two halves (gate+q on rank 0, k+v on rank 1) and each half chunked in four, so
every rank's q/k/v/gate hold the wrong rows. Found by ``tools/arch_sweep.py``: ``hrm_text`` with ``tp_size=2`` and
with ``fsdp_size=2`` (FSDP at load time is a ``Shard(0)`` DTensor layout, sliced the same way) trains silently wrong,
the first attention's output 100 % off.

The fix is generic: a checkpoint tensor that differs from its parameter along a dimension the parameter is sharded
on (:func:`shardadopt.loadtime.is_fused_source`) is read whole, the conversion runs on whole tensors, and each
converted tensor that comes out with its target's full shape is sharded by that target's own layout. The probe
reads the loader: a shard operation built from the first target's parameter and applied when the tensor is read,
with a ``WeightConverter.convert`` that shards nothing, means ``needed``.
"""

from __future__ import annotations

import inspect
from typing import Any

from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.versions import supported

MODULE = "transformers.core_model_loading"
SHARDING_MODULE = "transformers.distributed.sharding_utils"
FULL_SHAPE = "shardadopt_full_shape"  # set on each DtensorShardOperation: its parameter's global shape


def probe() -> Probe:
    import importlib

    from shardadopt.upstream.probing import undecided, upstream_function

    module = importlib.import_module(MODULE)
    where = f"{MODULE}.convert_and_load_state_dict_in_model / WeightConverter.convert"
    loader = inspect.getsource(upstream_function(module, "convert_and_load_state_dict_in_model", where))
    convert = inspect.getsource(inspect.unwrap(upstream_function(
        upstream_function(module, "WeightConverter", where), "convert", where)))
    if "shard" in convert:
        return Probe(False, "WeightConverter.convert shards the converted tensors itself")
    if "DtensorShardOperation(empty_param)" in loader and "sharding_op=sharding_op" in loader:
        return Probe(True, "a checkpoint tensor a conversion splits (a fused gate/q/k/v) is sliced with its first "
                           "target's shard bounds before it is split: every rank's pieces hold the wrong rows")
    raise undecided(where, "the shard operation of the first target applied while reading (the gap) nor a "
                           "WeightConverter.convert that shards its results (a fix)")


def _shape(tensor: Any) -> tuple[int, ...]:
    return tuple(tensor.shape) if hasattr(tensor, "shape") else tuple(tensor.get_shape())


def _fused(op: Any, tensor: Any) -> bool:
    """Whether ``op`` (the first target's shard operation) would slice ``tensor`` with the wrong bounds."""
    from shardadopt.loadtime import is_fused_source

    full = getattr(op, FULL_SHAPE, None)
    if full is not None:  # DtensorShardOperation: the dims its placements shard
        ndim = len(full)
        sharded = {p.dim % ndim for p in op.placements if hasattr(p, "dim")}
    elif hasattr(op, "get_expected_sharded_shape") and getattr(op, "empty_param", None) is not None:
        full = tuple(op.empty_param.shape)  # transformers 5.15's tensor-parallel layer
        sharded = {d for d, (a, b) in enumerate(zip(full, op.get_expected_sharded_shape(full))) if a != b}
    else:
        return False
    return is_fused_source(_shape(tensor), full, sharded)


def _shard_operation_init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    param = args[0] if args else kwargs["param"]
    setattr(instance, FULL_SHAPE, tuple(param.shape))


def _spawn_materialize(wrapped, instance, args, kwargs):
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    op = bound.arguments.get("sharding_op")
    if op is not None and _fused(op, bound.arguments["tensor"]):
        bound.arguments["sharding_op"] = None  # read it whole; WeightConverter.convert shards the results
    return wrapped(*bound.args, **bound.kwargs)


def _shard_whole(model: Any, name: str, value: Any, converter: Any) -> Any:
    """``value`` (a converted tensor for parameter ``name``) sharded by that parameter's layout when it is whole."""
    import torch
    from torch.distributed.tensor import DTensor

    from shardadopt import upstream

    if not isinstance(value, torch.Tensor):
        return value
    module_path, _, attribute = name.rpartition(".")
    try:
        ref = getattr(model.get_submodule(module_path) if module_path else model, attribute, None)
    except AttributeError:
        return value
    if ref is None or tuple(value.shape) != tuple(ref.shape):
        return value
    if isinstance(ref, DTensor):
        if tuple(upstream.dtensor_local(ref).shape) == tuple(ref.shape):
            return value
        from transformers.distributed.sharding_utils import DtensorShardOperation

        return DtensorShardOperation(ref).shard_tensor(value, device=value.device, dtype=value.dtype)
    op = getattr(converter, "distributed_operation", None)  # 5.15 tensor parallelism: the first target's layer
    if op is None or tuple(op.get_expected_sharded_shape(ref.shape)) == tuple(ref.shape):
        return value
    layer = type(op)(device_mesh=op.device_mesh, rank=op.rank, empty_param=ref.clone())  # as the loader builds it
    return layer.shard_tensor(value, device=value.device, dtype=value.dtype)


def _convert(wrapped, instance, args, kwargs):
    realized = wrapped(*args, **kwargs)
    model = inspect.signature(wrapped).bind(*args, **kwargs).arguments.get("model")
    if model is None or not isinstance(realized, dict):
        return realized
    out = {}
    for name, value in realized.items():
        if isinstance(value, list) and value:
            out[name] = [_shard_whole(model, name, value[0], instance), *value[1:]]
        else:
            out[name] = _shard_whole(model, name, value, instance)
    return out


PATCH = Patch(
    id="transformers-fused-weight-sharding",
    summary="loading a fused checkpoint tensor (HRM's gqkv_proj) into parameters sharded at load time: converted "
            "whole and each result sharded by its own layout (it was sliced with the first target's bounds "
            "before the split, every rank's q/k/v/gate the wrong rows: silently wrong under TP and FSDP)",
    upstream="proposal for transformers main (not reported yet)",
    requires=supported("transformers"),
    wrappers={Target(SHARDING_MODULE, "DtensorShardOperation.__init__"): _shard_operation_init,
              Target(MODULE, "spawn_materialize"): _spawn_materialize,
              Target(MODULE, "WeightConverter.convert"): _convert},
    probe=probe,
)
