"""Let ``ParallelismConfig`` (TP, HSDP, 2-D) run on CPU processes (``DistributedType.MULTI_CPU``, gloo).

Upstream (every supported accelerate, ``accelerate/parallelism_config.py``,
``ParallelismConfig._validate_accelerator``)::

    if self.total_size > 1 and not (
        accelerator.is_fsdp2
        or accelerator.multi_device
        or accelerator.distributed_type == DistributedType.DEEPSPEED
    ):
        raise ValueError(f"ParallelismConfig is only compatible DistributedType.FSDP (version 2) or ...")

``Accelerator.multi_device`` lists every ``MULTI_<accelerator>`` type but not ``MULTI_CPU``, so every CPU run with a
``ParallelismConfig`` is refused, including the one transformers' ``Trainer`` builds itself for a model loaded with
``DistributedConfig(tp_size=...)``. Nothing else needs it: the device mesh is built for ``accelerator.device.type``
("cpu": gloo), the dataloader split reads the mesh, and ``prepare_model`` keys its TP branch on
``parallelism_config.tp_enabled``, not on the device type. ``multi_device`` itself is left alone on purpose: its
other readers (``prepare_model``'s DDP branch passes ``device_ids=[local_process_index]``, ``join_uneven_inputs``,
``load_state``'s ``map_location``) are device-specific.

The fix accepts ``MULTI_CPU`` in this one check (validation runs against a view of the accelerator whose
``multi_device`` is true); every other check of ``_validate_accelerator`` runs unchanged. What the check kept out
must not go through silently instead: ``prepare_model``'s ``MULTI_CPU`` branch DDP-wraps a whole model, so a
``ParallelismConfig(dp_shard_size=N)`` (FSDP, which accelerate shards only through its GPU-only FSDP plugin) would
train full replicas. Such a model is refused for training, naming the fix (shard it while loading,
``DistributedConfig(fsdp_size=N)``; ``shardadopt.adopt.refuse_whole_model_for_dp_shard``); a load-time-sharded model
passes on to adoption.
"""

from __future__ import annotations

from typing import Any

from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream import PARALLELISM_CONFIG_VALIDATE_ACCELERATOR, validate_parallelism_config
from shardadopt.upstream.versions import supported

_REFUSAL = "ParallelismConfig is only compatible"


class _MultiDeviceView:
    """The accelerator as ``_validate_accelerator`` reads it, with ``multi_device`` true for CPU processes."""

    multi_device = True

    def __init__(self, accelerator: Any):
        object.__setattr__(self, "_accelerator", accelerator)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._accelerator, name, value)


def _prepare_model(wrapped, instance, args, kwargs):
    from shardadopt.adopt import adoption_kwargs, refuse_whole_model_for_dp_shard

    evaluation_mode = kwargs.get("evaluation_mode", args[2] if len(args) > 2 else False)
    if not evaluation_mode:  # evaluation never wraps
        model = args[0] if args else kwargs.get("model")
        refuse_whole_model_for_dp_shard(instance, model, adoption_kwargs(instance).topology)
    return wrapped(*args, **kwargs)


def _is_multi_cpu(accelerator: Any) -> bool:
    from accelerate.utils.dataclasses import DistributedType

    return accelerator.distributed_type == DistributedType.MULTI_CPU and accelerator.num_processes > 1


def _validate_accelerator(wrapped, instance, args, kwargs):
    accelerator = args[0] if args else kwargs.pop("accelerator")
    if _is_multi_cpu(accelerator):
        accelerator = _MultiDeviceView(accelerator)
    return wrapped(accelerator, *args[1:], **kwargs)


class _FakeCpuAccelerator:
    """The attributes ``_validate_accelerator`` reads, as a two-process CPU run has them."""

    multi_device = False
    is_fsdp2 = False
    num_processes = 2
    is_main_process = True

    def __init__(self) -> None:
        from accelerate.utils.dataclasses import DistributedType

        self.distributed_type = DistributedType.MULTI_CPU


def probe() -> Probe:
    from accelerate.parallelism_config import ParallelismConfig

    try:
        validate_parallelism_config(ParallelismConfig(tp_size=2), _FakeCpuAccelerator())
    except ValueError as exc:
        if _REFUSAL in str(exc):
            return Probe(True, "accelerate refuses ParallelismConfig for DistributedType.MULTI_CPU")
        raise
    return Probe(False, "accelerate accepts ParallelismConfig on CPU processes")


PATCH = Patch(
    id="accelerate-cpu-parallelism-config",
    summary="ParallelismConfig (TP, HSDP, 2-D) accepted for CPU processes (gloo)",
    upstream="anticipates huggingface/accelerate: count MULTI_CPU as multi-device in ParallelismConfig validation",
    requires=supported("accelerate", "transformers"),
    wrappers={PARALLELISM_CONFIG_VALIDATE_ACCELERATOR: _validate_accelerator,
              Target("accelerate.accelerator", "Accelerator.prepare_model"): _prepare_model},
    probe=probe,
)
