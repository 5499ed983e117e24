"""Every private upstream name shardadopt uses, each behind one named accessor.

torch, transformers, accelerate and optuna rename or drop private attributes between releases without notice. Here
each one is reached by a small function (or a constant naming it, for patch targets and probes that read upstream
source), whose docstring names the upstream object and the releases it was checked on; a missing name raises
:class:`UpstreamChanged` naming the accessor and the installed release instead of an ``AttributeError`` deep inside
training. ``tests/upstream/test_upstream_accessors.py`` runs every accessor against the installed upstream (so a rename
fails one test named after its accessor) and fails when code elsewhere in shardadopt spells a private upstream name.

"Checked on" ranges are the releases CI runs (torch 2.13.0/2.15.0, transformers 5.15.0/5.25.0, accelerate
1.13.0/1.16.0, optuna 4.9.0/5.0.0). Upstream modules are imported inside the accessors, because
``shardadopt.enable()`` (which imports the patch modules, and so the constants here) must not import them.

Long by design: this module is the one place the private-name guard allows such names, grouped by library, so
that a new upstream release is checked in one file.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any

from shardadopt.probing import Undecided, upstream_function
from shardadopt.versions import installed_version

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


@dataclass(frozen=True)
class Target:
    """An upstream object (a patch replaces it, a probe reads it): ``module`` plus a dotted ``qualname`` inside it."""

    module: str
    qualname: str

    def __str__(self) -> str:
        return f"{self.module}.{self.qualname}"


class UpstreamChanged(Undecided):
    """A private upstream name that an accessor of :mod:`shardadopt.upstream` reaches is gone in this release.

    An :class:`~shardadopt.probing.Undecided`, so a probe that hits it reports its patch ``unsupported``."""


def _changed(accessor: str, what: str, distribution: str) -> UpstreamChanged:
    version = installed_version(distribution)
    return UpstreamChanged(f"shardadopt.upstream.{accessor}: {what} does not exist in {distribution} "
                           f"{version or '(not installed)'} (renamed or removed upstream; shardadopt needs updating)")


_MISSING = object()


def _attribute(obj: Any, name: str, accessor: str, distribution: str) -> Any:
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        owner = obj if isinstance(obj, (type, ModuleType)) else type(obj)
        raise _changed(accessor, f"{getattr(owner, '__qualname__', owner.__name__)}.{name}", distribution)
    return value


_IMPORTED: dict[str, ModuleType] = {}  # accessors run per training step: import each module once


def _module_attribute(module: str, name: str, accessor: str, distribution: str) -> Any:
    owner = _IMPORTED.get(module)
    if owner is None:
        try:
            owner = _IMPORTED[module] = importlib.import_module(module)
        except ImportError as exc:
            raise _changed(accessor, f"module {module}", distribution) from exc
    return _attribute(owner, name, accessor, distribution)  # looked up each call: a replaced kernel is used


def upstream_method(target: Target, where: str) -> Callable[..., Any]:
    """The function ``target`` names (its module imported), for probes that read or run it; a missing class or
    method raises :class:`~shardadopt.probing.Undecided` saying ``<Class>.<method> does not exist in this release``."""
    *path, name = target.qualname.split(".")
    try:
        owner: Any = importlib.import_module(target.module)
    except ImportError as exc:
        raise Undecided(f"{where}: module {target.module} does not exist in this release (renamed or removed "
                        "upstream; the patch needs updating)") from exc
    for part in path:
        owner = upstream_function(owner, part, where)
    return upstream_function(owner, name, where)


# -- accelerate ------------------------------------------------------------------------------------------------------

def accelerator_models(accelerator: Any) -> list[Any]:
    """``Accelerator._models``: the list ``prepare()`` appends models to (mutable: appending registers a model).
    Checked on accelerate 1.13-1.16."""
    return _attribute(accelerator, "_models", "accelerator_models", "accelerate")


def accelerator_optimizers(accelerator: Any) -> list[Any]:
    """``Accelerator._optimizers``: the prepared (wrapped) optimizers. Checked on accelerate 1.13-1.16."""
    return _attribute(accelerator, "_optimizers", "accelerator_optimizers", "accelerate")


def accelerator_schedulers(accelerator: Any) -> list[Any]:
    """``Accelerator._schedulers``: the prepared schedulers. Checked on accelerate 1.13-1.16."""
    return _attribute(accelerator, "_schedulers", "accelerator_schedulers", "accelerate")


def accelerator_dataloaders(accelerator: Any) -> list[Any]:
    """``Accelerator._dataloaders``: the prepared dataloaders. Checked on accelerate 1.13-1.16."""
    return _attribute(accelerator, "_dataloaders", "accelerator_dataloaders", "accelerate")


def accelerator_custom_objects(accelerator: Any) -> list[Any]:
    """``Accelerator._custom_objects``: what ``register_for_checkpointing`` registered. Checked on accelerate
    1.13-1.16."""
    return _attribute(accelerator, "_custom_objects", "accelerator_custom_objects", "accelerate")


def accelerator_save_state_pre_hooks(accelerator: Any) -> dict[Any, Callable[..., Any]]:
    """``Accelerator._save_model_state_pre_hook``: handle -> hook, from ``register_save_state_pre_hook``. Checked
    on accelerate 1.13-1.16."""
    return _attribute(accelerator, "_save_model_state_pre_hook", "accelerator_save_state_pre_hooks", "accelerate")


def accelerator_load_state_pre_hooks(accelerator: Any) -> dict[Any, Callable[..., Any]]:
    """``Accelerator._load_model_state_pre_hook``: handle -> hook, from ``register_load_state_pre_hook``. Checked
    on accelerate 1.13-1.16."""
    return _attribute(accelerator, "_load_model_state_pre_hook", "accelerator_load_state_pre_hooks", "accelerate")


def is_accelerate_prepared(obj: Any) -> bool:
    """``obj._is_accelerate_prepared``: the flag ``Accelerator.prepare`` sets on models and dataloaders it prepared
    (unset, so False, on anything it did not). Checked on accelerate 1.13-1.16."""
    return bool(getattr(obj, "_is_accelerate_prepared", False))


def reset_accelerate_state() -> None:
    """``AcceleratorState._reset_state(reset_partial_state=True)`` and ``GradientState._reset_state()``: forget the
    process-wide accelerate singletons, so the next ``Accelerator()`` reads its configuration afresh. Checked on
    accelerate 1.13-1.16."""
    from accelerate.state import AcceleratorState, GradientState

    _attribute(AcceleratorState, "_reset_state", "reset_accelerate_state", "accelerate")(reset_partial_state=True)
    _attribute(GradientState, "_reset_state", "reset_accelerate_state", "accelerate")()


def reset_accelerator_state() -> None:
    """``AcceleratorState._reset_state()``: forget accelerate's process-wide accelerator state (its
    ``ParallelismConfig`` and plugins) but keep the process state (``PartialState``: ranks and backend), so the
    next ``Accelerator()`` takes its own ``parallelism_config``. Checked on accelerate 1.13-1.16."""
    from accelerate.state import AcceleratorState

    _attribute(AcceleratorState, "_reset_state", "reset_accelerator_state", "accelerate")()


# -- transformers ----------------------------------------------------------------------------------------------------

TRAINER_MODULE = "transformers.trainer"
# Private Trainer methods shardadopt's patches replace or probe. Checked on transformers 5.15-5.25.
TRAINER_MOVE_MODEL_TO_DEVICE = Target(TRAINER_MODULE, "Trainer._move_model_to_device")
TRAINER_PREPARE_FOR_TRAINING = Target(TRAINER_MODULE, "Trainer._prepare_for_training")
TRAINER_SAVE_CHECKPOINT = Target(TRAINER_MODULE, "Trainer._save_checkpoint")
TRAINER_LOAD_FROM_CHECKPOINT = Target(TRAINER_MODULE, "Trainer._load_from_checkpoint")
TRAINER_LOAD_OPTIMIZER_AND_SCHEDULER = Target(TRAINER_MODULE, "Trainer._load_optimizer_and_scheduler")
TRAINER_LOAD_BEST_MODEL = Target(TRAINER_MODULE, "Trainer._load_best_model")
TRAINER_SAVE_OPTIMIZER_AND_SCHEDULER = Target(TRAINER_MODULE, "Trainer._save_optimizer_and_scheduler")
TRAINER_TARGETS = (TRAINER_MOVE_MODEL_TO_DEVICE, TRAINER_PREPARE_FOR_TRAINING, TRAINER_SAVE_CHECKPOINT,
                   TRAINER_LOAD_FROM_CHECKPOINT, TRAINER_LOAD_OPTIMIZER_AND_SCHEDULER, TRAINER_LOAD_BEST_MODEL,
                   TRAINER_SAVE_OPTIMIZER_AND_SCHEDULER)

# ``Trainer.save_model(output_dir, _internal_call=False)``'s private keyword. Checked on transformers 5.15-5.25.
SAVE_MODEL_INTERNAL_CALL = "_internal_call"

# Attributes ``from_pretrained(..., distributed_config=...)`` sets on a model, as probes find them in upstream
# source: the device mesh, and the sharding degrees. Checked on transformers 5.15-5.25.
MODEL_DEVICE_MESH_ATTRIBUTE = "_device_mesh"
MODEL_SHARDING_SIZE_ATTRIBUTES = ("_tp_size", "_fsdp_size")

# The name of transformers' grouped GEMM helper that ``grouped_mm_experts_forward`` calls, as a probe finds it in
# upstream source (``transformers.integrations.moe._grouped_linear``). Checked on transformers 5.15-5.25.
MOE_GROUPED_LINEAR = "_grouped_linear"


def trainer_output_dir(trainer: Any, trial: Any) -> str:
    """``Trainer._get_output_dir(trial=trial)``: the run directory checkpoints go to (per trial under HPO).
    Checked on transformers 5.15-5.25."""
    return _attribute(trainer, "_get_output_dir", "trainer_output_dir", "transformers")(trial=trial)


def trainer_save_scaler(trainer: Any, output_dir: str) -> None:
    """``Trainer._save_scaler(output_dir)``: the grad scaler's state. Checked on transformers 5.15-5.25."""
    _attribute(trainer, "_save_scaler", "trainer_save_scaler", "transformers")(output_dir)


def trainer_save_rng_state(trainer: Any, output_dir: str) -> None:
    """``Trainer._save_rng_state(output_dir)``: this process's RNG states. Checked on transformers 5.15-5.25."""
    _attribute(trainer, "_save_rng_state", "trainer_save_rng_state", "transformers")(output_dir)


def trainer_push_from_checkpoint(trainer: Any, checkpoint_dir: str) -> None:
    """``Trainer._push_from_checkpoint(checkpoint_dir)``: the hub upload of a saved checkpoint. Checked on
    transformers 5.15-5.25."""
    _attribute(trainer, "_push_from_checkpoint", "trainer_push_from_checkpoint", "transformers")(checkpoint_dir)


def model_device_mesh(model: Any) -> Any:
    """``PreTrainedModel._device_mesh``: the mesh a model was sharded on at load time; None (the class default) for
    a model loaded without ``distributed_config``. Checked on transformers 5.15-5.25."""
    return getattr(model, MODEL_DEVICE_MESH_ATTRIBUTE, None)


def model_mesh_manager(model: Any) -> Any:
    """``PreTrainedModel._mesh_manager``: the ``TransformersDeviceMesh`` (dense and expert meshes) of a model
    sharded at load time; None for other models, and on releases before 5.19 (which have none). Checked on
    transformers 5.15-5.25."""
    return getattr(model, "_mesh_manager", None)


def is_mesh_manager(obj: Any) -> bool:
    """Whether ``obj`` is a ``transformers.distributed.utils.TransformersDeviceMesh`` (False on releases without
    that class). Checked on transformers 5.15-5.25."""
    try:
        from transformers.distributed.utils import TransformersDeviceMesh
    except ImportError:
        return False
    return isinstance(obj, TransformersDeviceMesh)


def mesh_manager_meshes(manager: Any) -> tuple[Any, Any]:
    """``(TransformersDeviceMesh._dense_mesh, TransformersDeviceMesh._expert_mesh)``: the (pp, [dp_replicate,]
    fsdp, tp) and (pp, [dp_replicate,] efsdp, ep) meshes (the class exists from 5.19). Checked on transformers
    5.24-5.25."""
    return (_attribute(manager, "_dense_mesh", "mesh_manager_meshes", "transformers"),
            _attribute(manager, "_expert_mesh", "mesh_manager_meshes", "transformers"))


def set_model_sharding_sizes(model: Any, tp_size: int, fsdp_size: int) -> None:
    """Set ``PreTrainedModel._tp_size`` / ``_fsdp_size``, the degrees its ``tp_size`` / ``fsdp_size`` properties
    return. Checked on transformers 5.15-5.25 (a plain attribute write: nothing to be missing)."""
    tp_name, fsdp_name = MODEL_SHARDING_SIZE_ATTRIBUTES
    setattr(model, tp_name, tp_size)
    setattr(model, fsdp_name, fsdp_size)


def from_config_constructor(model_class: type) -> Callable[..., Any] | None:
    """``PreTrainedModel._from_config``: builds a model from a config honouring the dtype/attention settings;
    None for a class that is not a transformers model. Checked on transformers 5.15-5.25."""
    return getattr(model_class, "_from_config", None)


def experts_is_expert_parallel(experts: Any) -> bool | None:
    """``experts._is_expert_parallel``: whether transformers sharded an experts module by expert; None when unset
    (releases before 5.18 never set it). Checked on transformers 5.15-5.25."""
    return getattr(experts, "_is_expert_parallel", None)


def set_experts_expert_parallel(experts: Any, flag: bool) -> None:
    """Set ``experts._is_expert_parallel`` (read by transformers >= 5.18; earlier releases ignore it)."""
    experts._is_expert_parallel = flag


def experts_apply_gate(experts: Any, projected: torch.Tensor) -> torch.Tensor:
    """``experts._apply_gate(projected)``: the gated activation of a gate+up projection. Checked on transformers
    5.15-5.25."""
    return _attribute(experts, "_apply_gate", "experts_apply_gate", "transformers")(projected)


def moe_grouped_linear() -> Callable[..., torch.Tensor]:
    """``transformers.integrations.moe._grouped_linear``: the grouped GEMM (kernel choice included) that
    ``grouped_mm_experts_forward`` calls. Checked on transformers 5.15-5.25."""
    return _module_attribute("transformers.integrations.moe", MOE_GROUPED_LINEAR, "moe_grouped_linear", "transformers")


def moe_can_use_grouped_mm(hidden: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> bool:
    """``transformers.integrations.moe._can_use_grouped_mm``: whether ``_grouped_linear`` runs torch's grouped_mm
    kernel for these operands (else its fallback loop). Checked on transformers 5.15-5.25."""
    return _module_attribute("transformers.integrations.moe", "_can_use_grouped_mm", "moe_can_use_grouped_mm",
                             "transformers")(hidden, weight, offsets)


def module_hf_device_mesh(module: torch.nn.Module) -> Any:
    """``module._hf_device_mesh``: the mesh transformers 5.15's tensor parallelism records on the modules it shards;
    None where it is unset (other modules; 5.16 and later never set it). Checked on transformers 5.15-5.25."""
    return getattr(module, "_hf_device_mesh", None)


# -- peft ------------------------------------------------------------------------------------------------------------

# ``LoraLayer._get_in_out_features(base_layer)``: the (in, out) features peft sizes LoRA factors by, which
# ``peft-sharded-adapters`` replaces (global shapes for DTensor bases). Checked on peft 0.21.2.
PEFT_LORA_IN_OUT_FEATURES = Target("peft.tuners.lora.layer", "LoraLayer._get_in_out_features")


def peft_in_out_features() -> Callable[..., Any]:
    """``peft.tuners.tuners_utils._get_in_out_features``: the function peft's tuner layers size themselves with,
    which the ``peft-sharded-adapters`` probe reads. Checked on peft 0.21.2."""
    return _module_attribute("peft.tuners.tuners_utils", "_get_in_out_features", "peft_in_out_features", "peft")


# -- torch -----------------------------------------------------------------------------------------------------------

def default_store() -> dist.Store:
    """``torch.distributed.distributed_c10d._get_default_store()``: the default group's rendezvous store. Checked on
    torch 2.13-2.15."""
    import torch.distributed as dist

    return _attribute(dist.distributed_c10d, "_get_default_store", "default_store", "torch")()


def default_group() -> dist.ProcessGroup:
    """``torch.distributed.distributed_c10d._get_default_group()``: the default (world) process group object.
    Checked on torch 2.13-2.15."""
    import torch.distributed as dist

    return _attribute(dist.distributed_c10d, "_get_default_group", "default_group", "torch")()


def registered_process_groups() -> list[dist.ProcessGroup]:
    """``torch.distributed.distributed_c10d._world.pg_map``'s keys: every live process group of this process, the
    default one included (destroyed groups leave it). A snapshot; torch may add a group while it is taken, which
    raises ``RuntimeError`` (dictionary changed size) for the caller to retry. Checked on torch 2.13-2.15."""
    import torch.distributed as dist

    world = _attribute(dist.distributed_c10d, "_world", "registered_process_groups", "torch")
    return list(_attribute(world, "pg_map", "registered_process_groups", "torch"))


def process_group_counter() -> int:
    """``torch.distributed.distributed_c10d._world.group_count``: the number torch names the next process group
    after (numbered names; on torch 2.15 also the salt of hashed ones); ``destroy_process_group()`` sets it back to
    0. Checked on torch 2.13-2.15."""
    import torch.distributed as dist

    world = _attribute(dist.distributed_c10d, "_world", "process_group_counter", "torch")
    return _attribute(world, "group_count", "process_group_counter", "torch")


def set_process_group_counter(value: int) -> None:
    """Set ``torch.distributed.distributed_c10d._world.group_count`` (see ``process_group_counter``); every rank
    must set the same value (group names must agree). Checked on torch 2.13-2.15."""
    import torch.distributed as dist

    world = _attribute(dist.distributed_c10d, "_world", "set_process_group_counter", "torch")
    _attribute(world, "group_count", "set_process_group_counter", "torch")
    world.group_count = value


def group_timeout(group: dist.ProcessGroup, device: torch.device) -> timedelta:
    """``group._get_backend(device).options._timeout``: the timeout the group's backend for ``device`` was created
    with. Checked on torch 2.13-2.15."""
    backend = _attribute(group, "_get_backend", "group_timeout", "torch")(device)
    return _attribute(_attribute(backend, "options", "group_timeout", "torch"), "_timeout", "group_timeout", "torch")


def backend_device_types(group: dist.ProcessGroup | None = None) -> list[str]:
    """``torch.distributed.distributed_c10d._device_capability(group)``: the device types the group's backend
    runs collectives on (``["cpu"]`` for gloo on a CPU build). Checked on torch 2.13-2.15."""
    import torch.distributed as dist

    return _attribute(dist.distributed_c10d, "_device_capability", "backend_device_types", "torch")(group)


def _foreach_utils(name: str, accessor: str) -> Callable[..., Any]:
    return _module_attribute("torch.utils._foreach_utils", name, accessor, "torch")


def has_foreach_support(tensors: Sequence[torch.Tensor], device: torch.device) -> bool:
    """``torch.utils._foreach_utils._has_foreach_support``. Checked on torch 2.13-2.15."""
    return _foreach_utils("_has_foreach_support", "has_foreach_support")(tensors, device)


def device_has_foreach_support(device: torch.device) -> bool:
    """``torch.utils._foreach_utils._device_has_foreach_support``. Checked on torch 2.13-2.15."""
    return _foreach_utils("_device_has_foreach_support", "device_has_foreach_support")(device)


def group_tensors_by_device_and_dtype(tensorlistlist: list[list[torch.Tensor]]) -> dict[Any, Any]:
    """``torch.utils._foreach_utils._group_tensors_by_device_and_dtype``: ``{(device, dtype): (lists, indices)}``.
    Checked on torch 2.13-2.15."""
    return _foreach_utils("_group_tensors_by_device_and_dtype", "group_tensors_by_device_and_dtype")(tensorlistlist)


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor | float) -> None:
    """``torch._foreach_mul_``: in-place multiply of a tensor list. Checked on torch 2.13-2.15."""
    import torch

    _attribute(torch, "_foreach_mul_", "foreach_mul_", "torch")(tensors, scalar)


def foreach_norm(tensors: list[torch.Tensor], ord: float, **kwargs: Any) -> Sequence[torch.Tensor]:
    """``torch._foreach_norm`` (``dtype=`` among ``kwargs``). Checked on torch 2.13-2.15."""
    import torch

    return _attribute(torch, "_foreach_norm", "foreach_norm", "torch")(tensors, ord, **kwargs)


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """``torch.autograd.Variable._execution_engine.queue_callback``: run ``callback`` once the running backward has
    finished (every gradient accumulated); callable only from inside a backward (a hook). What DDP and FSDP use to
    reduce after the last gradient. Checked on torch 2.13-2.15."""
    import torch

    engine = _attribute(torch.autograd.Variable, "_execution_engine", "queue_backward_callback", "torch")
    _attribute(engine, "queue_callback", "queue_backward_callback", "torch")(callback)


def current_graph_task_id() -> int:
    """``torch._C._current_graph_task_id()``: the id of the backward running on this thread (a new one per
    ``backward()``), -1 outside one. Checked on torch 2.13-2.15."""
    import torch

    return _attribute(torch._C, "_current_graph_task_id", "current_graph_task_id", "torch")()


# The op namespaces of torch's collectives as a dispatch mode sees them: ``torch.distributed`` calls (``c10d``) and
# the functional collectives DTensor issues (native and autograd). Checked on torch 2.13-2.15.
COLLECTIVE_OP_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})


def torch_dispatch_mode() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: the base class of modes that see every op dispatched below
    autograd (collectives included: what ``CommDebugMode`` derives from). Checked on torch 2.13-2.15."""
    return _module_attribute("torch.utils._python_dispatch", "TorchDispatchMode", "torch_dispatch_mode", "torch")


def pytree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """``torch.utils._pytree.tree_flatten``: the leaves of nested lists, tuples and dicts (an op's arguments) and the
    spec whose ``unflatten(leaves)`` rebuilds them. Checked on torch 2.13-2.15."""
    return _module_attribute("torch.utils._pytree", "tree_flatten", "pytree_flatten", "torch")(tree)


def wait_functional_collective(tensor: torch.Tensor) -> torch.Tensor:
    """``torch.ops._c10d_functional.wait_tensor``: wait for the functional collective (DTensor's) that produces
    ``tensor``; the tensor itself when none is pending. Checked on torch 2.13-2.15."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the op)

    ops = _attribute(torch.ops, "_c10d_functional", "wait_functional_collective", "torch")
    return _attribute(ops, "wait_tensor", "wait_functional_collective", "torch")(tensor)


def dtensor_local(tensor: Any) -> torch.Tensor:
    """``DTensor._local_tensor``: the local shard itself, outside autograd (``to_local()`` records a graph node).
    Checked on torch 2.13-2.15."""
    return _attribute(tensor, "_local_tensor", "dtensor_local", "torch")


def strided_shard_type() -> type:
    """``torch.distributed.tensor.placement_types._StridedShard``: the placement FSDP x TP layouts use (not a
    ``Shard`` subclass in 2.13-2.15). Checked on torch 2.13-2.15."""
    return _module_attribute("torch.distributed.tensor.placement_types", "_StridedShard", "strided_shard_type", "torch")


def compute_local_shape_and_global_offset(global_shape: Any, mesh_shape: Any, coordinate: list[int],
                                          placements: Sequence[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``: the shape and offset of the
    piece the rank at ``coordinate`` holds. Checked on torch 2.13-2.15."""
    return _module_attribute("torch.distributed.tensor._utils", "_compute_local_shape_and_global_offset",
                             "compute_local_shape_and_global_offset", "torch")(
        global_shape, mesh_shape, coordinate, placements)


def fsdp_param_groups(module: torch.nn.Module) -> list[Any]:
    """``FSDPModule._get_fsdp_state()._fsdp_param_groups``: the parameter groups (mesh info, reduction settings)
    of a module ``fully_shard`` wrapped. Checked on torch 2.13-2.15."""
    state = _attribute(module, "_get_fsdp_state", "fsdp_param_groups", "torch")()
    groups = _attribute(state, "_fsdp_param_groups", "fsdp_param_groups", "torch")
    return list(groups) if groups is not None else []


def fsdp_group_syncs_gradients(group: Any) -> bool:
    """``FSDPParamGroup.reduce_grads``: False while gradient reduction waits (``set_requires_gradient_sync(False)``,
    FSDP2's ``no_sync`` under accumulation), True in the micro-batch that reduces. Checked on torch 2.13-2.15."""
    return bool(_attribute(group, "reduce_grads", "fsdp_group_syncs_gradients", "torch"))


def fsdp_managed_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters ``fully_shard`` manages in ``module``'s own parameter groups, as registered on their modules
    now (``FSDPParam._module_info``: the module and name; its ``sharded_param`` is stale until FSDP's lazy init when
    the parameter was replaced after ``fully_shard``, as transformers' load does). Parameters added later (LoRA
    factors) are not among them. Checked on torch 2.13-2.15."""
    params = []
    for group in fsdp_param_groups(module):
        for fsdp_param in _attribute(group, "fsdp_params", "fsdp_managed_parameters", "torch"):
            info = _attribute(fsdp_param, "_module_info", "fsdp_managed_parameters", "torch")
            params.append(getattr(info.module, info.param_name))
    return params


def accelerator_type() -> str:
    """``torch._C._get_accelerator().type``: the current accelerator's device type, ``"cpu"`` without one (where
    ``torch.accelerator.current_accelerator()`` returns None). Checked on torch 2.13-2.15."""
    import torch

    return _attribute(torch._C, "_get_accelerator", "accelerator_type", "torch")().type


def module_backward_hooks(module: torch.nn.Module) -> dict[int, Callable[..., Any]]:
    """``nn.Module._backward_hooks``: handle id -> hook of ``register_full_backward_hook`` (mutable: deleting a key
    removes the hook). Checked on torch 2.13-2.15."""
    return _attribute(module, "_backward_hooks", "module_backward_hooks", "torch")


def module_forward_pre_hooks(module: torch.nn.Module) -> dict[int, Callable[..., Any]]:
    """``nn.Module._forward_pre_hooks``: handle id -> hook of ``register_forward_pre_hook`` (mutable: deleting the
    key of a hook registered without ``with_kwargs`` removes it). Checked on torch 2.13-2.15."""
    return _attribute(module, "_forward_pre_hooks", "module_forward_pre_hooks", "torch")


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> dict[int, Callable[..., Any]]:
    """``Tensor._post_accumulate_grad_hooks``: handle id -> hook of ``register_post_accumulate_grad_hook``
    (mutable); empty when none was registered (upstream leaves it None). Checked on torch 2.13-2.15."""
    hooks = _attribute(tensor, "_post_accumulate_grad_hooks", "post_accumulate_grad_hooks", "torch")
    return hooks if hooks is not None else {}


def compiled_original(model: torch.nn.Module) -> torch.nn.Module | None:
    """``OptimizedModule._orig_mod``: the module ``torch.compile`` wrapped; None for a model that is not compiled.
    Checked on torch 2.13-2.15."""
    return getattr(model, "_orig_mod", None)


def clear_sharding_propagation_caches() -> None:
    """``torch.distributed.tensor.debug._clear_sharding_prop_cache()``: empty DTensor's sharding-propagation caches
    (the Python ``lru_cache`` and the C++ fast path's). Their keys hold device meshes, which compare equal by rank
    layout and dim names alone, so after the process groups were re-initialised a hit hands out the output spec
    of an earlier generation's mesh, whose group names are gone or name new, unrelated groups. Checked on torch
    2.13-2.15."""
    _module_attribute("torch.distributed.tensor.debug", "_clear_sharding_prop_cache",
                      "clear_sharding_propagation_caches", "torch")()


# -- Python ----------------------------------------------------------------------------------------------------------

def module_initializing(module: Any) -> bool:
    """``module.__spec__._initializing``: whether importlib is still executing the module (unset, so False, once
    done and for modules imported without a spec). Checked on CPython 3.10-3.13."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def thread_frame(ident: int | None) -> Any:
    """``sys._current_frames()[ident]``: the innermost Python frame thread ``ident`` is running, or None (no such
    thread). CPython's; the frames of other threads are read without stopping them. Checked on CPython 3.10-3.13."""
    return _attribute(sys, "_current_frames", "thread_frame", "python")().get(ident)


# -- optuna ----------------------------------------------------------------------------------------------------------

def study_storage(study: Any) -> Any:
    """``Study._storage``: the ``BaseStorage`` a study reads and writes (what heartbeats, failure records and
    requeue write to by trial id; ``optuna.Study`` has no public getter). Checked on optuna 4.9-5.0."""
    return _attribute(study, "_storage", "study_storage", "optuna")


def trial_id(trial: Any) -> int:
    """``Trial._trial_id`` / ``FrozenTrial._trial_id``: the storage's id of a trial (unique across the studies of a
    storage, unlike ``number``), which every ``BaseStorage`` method takes. Checked on optuna 4.9-5.0."""
    return _attribute(trial, "_trial_id", "trial_id", "optuna")


# -- patch targets and the private hooks their probes read ----------------------------------------------------------

# ``ParallelismConfig._validate_accelerator(accelerator)``, which ``accelerate-cpu-parallelism-config`` wraps.
# Checked on accelerate 1.13-1.16.
PARALLELISM_CONFIG_VALIDATE_ACCELERATOR = Target("accelerate.parallelism_config",
                                                 "ParallelismConfig._validate_accelerator")

# ``Trainer._report_to_hp_search(trial, step, metrics)``, which ``trainer-hpo-optuna`` wraps. Checked on transformers
# 5.15-5.25.
TRAINER_REPORT_TO_HP_SEARCH = Target(TRAINER_MODULE, "Trainer._report_to_hp_search")

# transformers 5.15's local-tensor tensor-parallel layers and their forward hooks, which
# ``transformers-ep-router-grad`` and ``transformers-tp-legacy-layers`` wrap; 5.16 replaced them with DTensor layers
# without these hooks (the targets are missing there). Checked on transformers 5.15-5.25.
TENSOR_PARALLEL_MODULE = "transformers.integrations.tensor_parallel"
ROUTER_PARALLEL_PREPARE_OUTPUT = Target(TENSOR_PARALLEL_MODULE, "RouterParallel._prepare_output_fn")
EMBEDDING_PARALLEL_PREPARE_INPUT = Target(TENSOR_PARALLEL_MODULE, "EmbeddingParallel._prepare_input_fn")
ROWWISE_PARALLEL_PREPARE_INPUT = Target(TENSOR_PARALLEL_MODULE, "RowwiseParallel._prepare_input_fn")
ROWWISE_PARALLEL_PREPARE_OUTPUT = Target(TENSOR_PARALLEL_MODULE, "RowwiseParallel._prepare_output_fn")


def validate_parallelism_config(config: Any, accelerator: Any) -> None:
    """``ParallelismConfig._validate_accelerator(accelerator)``: accelerate's check that ``accelerator`` can run
    ``config`` (raises ``ValueError`` when it cannot). Checked on accelerate 1.13-1.16."""
    _attribute(config, "_validate_accelerator", "validate_parallelism_config", "accelerate")(accelerator)


def tp_layer_input_hook(layer_class: type | None) -> Any:
    """``layer_class._prepare_input_fn`` as the class defines it (``inspect.getattr_static``: no descriptor runs):
    the input hook of transformers 5.15's local-tensor TP layers; None for a layer without one (the DTensor layers of
    5.16 and later) or no class. Checked on transformers 5.15-5.25."""
    import inspect

    return inspect.getattr_static(layer_class, "_prepare_input_fn", None) if layer_class is not None else None


def tp_layer_output_hook(layer: Any) -> Callable[..., Any] | None:
    """``layer._prepare_output_fn`` (``layer`` a TP layer class or instance): the output hook of transformers 5.15's
    local-tensor TP layers, bound for an instance; None for a layer without one (5.16 and later) or None. Checked on
    transformers 5.15-5.25."""
    return getattr(layer, "_prepare_output_fn", None)


# -- the Trainer's own sync of replicated trainable parameters (transformers 5.25+) ---------------------------------

# ``Trainer._sync_replicated_trainable_parameters`` hooks every trainable plain (non-DTensor) parameter of a model
# sharded at load time once, and marks it with this attribute so that a second ``train()`` does not hook it again.
_TRAINER_REPLICATED_HOOK_FLAG = "_replicated_grad_hook_registered"


def trainer_replicated_sync() -> Callable[..., Any] | None:
    """``Trainer._sync_replicated_trainable_parameters``: the Trainer's broadcast of rank 0's trainable plain
    parameters and all-rank average of their gradients (transformers 5.25); None on releases without it. Checked on
    transformers 5.15-5.25."""
    from transformers import Trainer

    return getattr(Trainer, "_sync_replicated_trainable_parameters", None)


def leave_out_of_trainer_replicated_sync(param: Any) -> None:
    """Mark ``param`` as already hooked for :func:`trainer_replicated_sync`, so that the Trainer adds no gradient
    average of its own (it still broadcasts rank 0's value, which a laid-out adapter already holds). Harmless on
    releases without that sync. Checked on transformers 5.25."""
    setattr(param, _TRAINER_REPLICATED_HOOK_FLAG, True)


def experts_implementation(config: Any) -> str | None:
    """``config._experts_implementation``: the experts kernel a model was loaded with (``experts_implementation=`` of
    ``from_pretrained``: "grouped_mm", "deepgemm_megamoe", ...), None when unset or absent. Checked on transformers
    5.15-5.25."""
    return getattr(config, "_experts_implementation", None)
