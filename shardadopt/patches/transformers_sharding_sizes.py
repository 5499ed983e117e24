"""F1: a model sharded at load time records ``_tp_size`` and ``_fsdp_size`` and exposes ``fsdp_size``.

Upstream: transformers#48208 (``_tp_size``) and #48204 (``_fsdp_size``, ``fsdp_size``); released in 5.18.
In 5.15 .. 5.17
``DistributedMixin.maybe_distribute_model`` (``transformers/distributed/mixin.py``) records only the mesh::

    model.config.distributed_config = distributed_config
    model._device_mesh = device_mesh

``_tp_size`` is set by ``apply_tensor_parallelism`` only when ``tp_size > 1`` (5.15) or never (5.16), and nothing
records the FSDP degree, so Trainer builds no ``ParallelismConfig`` for an FSDP model and accelerate wraps it in
DDP. 5.18 adds, right after the mesh::

    model._tp_size = distributed_config.tp_size
    model._fsdp_size = distributed_config.fsdp_size

plus a ``PreTrainedModel.fsdp_size`` property. The wrapper calls :func:`shardadopt.loadtime.record_sharding_degrees`
on the model ``maybe_distribute_model`` returns when it was given a mesh; ``fsdp_size`` becomes an attribute of
that model (models loaded without ``distributed_config`` are untouched).
"""

from __future__ import annotations

import ast

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe
from shardadopt.upstream.probing import source_tree, undecided
from shardadopt.upstream.versions import supported


def _assigned_attributes(function) -> set[str]:
    return {target.attr for node in ast.walk(source_tree(function)) if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Attribute)}


def probe() -> Probe:
    """Parse ``DistributedMixin.maybe_distribute_model``: which attributes it sets on the model next to the mesh."""
    # Only the mixin is inspected: this runs while transformers.modeling_utils is still importing it.
    where = f"{PATCH.id} probe"
    assigned = _assigned_attributes(upstream.upstream_method(upstream.MAYBE_DISTRIBUTE_MODEL, where))
    if upstream.MODEL_DEVICE_MESH_ATTRIBUTE not in assigned:
        raise undecided("DistributedMixin.maybe_distribute_model", "where it records the model's _device_mesh")
    missing = sorted(set(upstream.MODEL_SHARDING_SIZE_ATTRIBUTES) - assigned)
    if not missing:
        return Probe(False, "maybe_distribute_model records _tp_size and _fsdp_size")
    return Probe(True, f"maybe_distribute_model records the mesh but not {' or '.join(missing)} on the model")


def _maybe_distribute_model(wrapped, instance, args, kwargs):
    from shardadopt.loadtime import record_sharding_degrees

    call = upstream.bind_maybe_distribute_model(wrapped, args, kwargs)
    model = wrapped(*args, **kwargs)
    if call.shards:
        record_sharding_degrees(model, call.distributed_config)
    return model


def _sharded(model, layout) -> bool:
    """Every load-time-sharded model needs its sharding degrees recorded (Trainer and accelerate read them)."""
    return layout.is_sharded



PATCH = Patch(
    id="transformers-sharding-sizes",
    summary="models sharded at load time record _tp_size/_fsdp_size and expose fsdp_size (Trainer needs them)",
    upstream="huggingface/transformers#48208 (_tp_size), huggingface/transformers#48204 (_fsdp_size, fsdp_size)",
    requires=supported("transformers"),
    wrappers={upstream.MAYBE_DISTRIBUTE_MODEL: _maybe_distribute_model},
    needed_by=_sharded,
    probe=probe,
)
