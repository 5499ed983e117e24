"""torch's private names: the default group and store, process-group bookkeeping, foreach kernels, autograd's
engine, DTensor and FSDP2 internals (context parallelism's are in ``torch_context_parallel``). Checked on torch
2.13-2.15."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from shardadopt.upstream.base import Target, attribute, module_attribute

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


def default_store() -> dist.Store:
    """``torch.distributed.distributed_c10d._get_default_store()``: the default group's rendezvous store. Checked on
    torch 2.13-2.15."""
    import torch.distributed as dist

    return attribute(dist.distributed_c10d, "_get_default_store", "default_store", "torch")()


def c10d_store_factory() -> Callable[..., dist.Store]:
    """``torch.distributed.rendezvous._create_c10d_store``: the store the ``env://`` and ``tcp://`` rendezvous hand
    ``init_process_group``; under torchrun a client of the agent's store. Checked on torch 2.13-2.15."""
    return module_attribute("torch.distributed.rendezvous", "_create_c10d_store", "c10d_store_factory", "torch")


# The functions ``_create_c10d_store`` calls to choose the torchrun agent's store (2.13:
# ``_torchelastic_use_agent_store``; 2.15: ``_agent_store_serves``, which also checks the address). Checked on torch
# 2.13-2.15.
AGENT_STORE_CHECKS = frozenset({"_torchelastic_use_agent_store", "_agent_store_serves"})


# What code reads to get a DTensor parameter's local shard or its shape (torch's ``DTensor.to_local`` and
# ``_local_tensor``, transformers' ``local_shape`` / ``get_expected_sharded_shape`` helpers): the
# transformers-sharded-transpose-check probe takes a ``Transpose.convert`` that reads one of them for the fix.
# Checked on torch 2.13-2.15, transformers 5.15-5.25.
LOCAL_SHARD_READERS = frozenset({"to_local", "_local_tensor", "local_shape", "get_expected_sharded_shape"})


# ``torch.distributed.tensor._redistribute.Redistribute.backward``: the backward of ``DTensor.redistribute`` and
# ``full_tensor``, which turns the output's gradient back into the input's placements. Checked on torch 2.13-2.15.
REDISTRIBUTE_BACKWARD = Target("torch.distributed.tensor._redistribute", "Redistribute.backward")


# ``torch.distributed.checkpoint.filesystem.FileSystemReader.read_metadata``: reads a DCP checkpoint's ``.metadata``
# with ``pickle.load``. Checked on torch 2.13-2.15.
DCP_READ_METADATA = Target("torch.distributed.checkpoint.filesystem", "FileSystemReader.read_metadata")

# The module whose classes DCP's ``.metadata`` pickles (``Metadata``, ``TensorStorageMetadata``,
# ``BytesStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties``, ``MetadataIndex``, ``StorageMeta``,
# ``_MEM_FORMAT_ENCODING``), and the other globals its pickle names besides torch dtypes: the filesystem storage's
# ``_StorageInfo``, ``torch.Size``, ``torch.serialization._get_layout`` (a layout from its name) and the checkpoint
# path (``pathlib``). Read from the pickles torch 2.13 and 2.15 write (the same set on both).
DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
DCP_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
})


def dcp_metadata_path(reader: Any, rank: int | None) -> Any:
    """``FileSystemReader._get_metadata_path(rank)``: where a DCP reader finds its ``.metadata`` (``__<rank>`` prefix
    for a rank's own). Checked on torch 2.13-2.15."""
    return attribute(reader, "_get_metadata_path", "dcp_metadata_path", "torch")(rank)


def default_group() -> dist.ProcessGroup:
    """``torch.distributed.distributed_c10d._get_default_group()``: the default (world) process group object.
    Checked on torch 2.13-2.15."""
    import torch.distributed as dist

    return attribute(dist.distributed_c10d, "_get_default_group", "default_group", "torch")()


def registered_process_groups() -> list[dist.ProcessGroup]:
    """``torch.distributed.distributed_c10d._world.pg_map``'s keys: every live process group of this process, the
    default one included (destroyed groups leave it). A snapshot; torch may add a group while it is taken, which
    raises ``RuntimeError`` (dictionary changed size) for the caller to retry. Checked on torch 2.13-2.15."""
    import torch.distributed as dist

    world = attribute(dist.distributed_c10d, "_world", "registered_process_groups", "torch")
    return list(attribute(world, "pg_map", "registered_process_groups", "torch"))


def process_group_counter() -> int:
    """``torch.distributed.distributed_c10d._world.group_count``: the number torch names the next process group
    after (numbered names; on torch 2.15 also the salt of hashed ones); ``destroy_process_group()`` sets it back to
    0. Checked on torch 2.13-2.15."""
    import torch.distributed as dist

    world = attribute(dist.distributed_c10d, "_world", "process_group_counter", "torch")
    return attribute(world, "group_count", "process_group_counter", "torch")


def set_process_group_counter(value: int) -> None:
    """Set ``torch.distributed.distributed_c10d._world.group_count`` (see ``process_group_counter``); every rank
    must set the same value (group names must agree). Checked on torch 2.13-2.15."""
    import torch.distributed as dist

    world = attribute(dist.distributed_c10d, "_world", "set_process_group_counter", "torch")
    attribute(world, "group_count", "set_process_group_counter", "torch")
    world.group_count = value


def group_timeout(group: dist.ProcessGroup, device: torch.device) -> timedelta:
    """``group._get_backend(device).options._timeout``: the timeout the group's backend for ``device`` was created
    with. Checked on torch 2.13-2.15."""
    backend = attribute(group, "_get_backend", "group_timeout", "torch")(device)
    return attribute(attribute(backend, "options", "group_timeout", "torch"), "_timeout", "group_timeout", "torch")


def backend_device_types(group: dist.ProcessGroup | None = None) -> list[str]:
    """``torch.distributed.distributed_c10d._device_capability(group)``: the device types the group's backend
    runs collectives on (``["cpu"]`` for gloo on a CPU build). Checked on torch 2.13-2.15."""
    import torch.distributed as dist

    return attribute(dist.distributed_c10d, "_device_capability", "backend_device_types", "torch")(group)


def _foreach_utils(name: str, accessor: str) -> Callable[..., Any]:
    return module_attribute("torch.utils._foreach_utils", name, accessor, "torch")


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

    attribute(torch, "_foreach_mul_", "foreach_mul_", "torch")(tensors, scalar)


def foreach_norm(tensors: list[torch.Tensor], ord: float, **kwargs: Any) -> Sequence[torch.Tensor]:
    """``torch._foreach_norm`` (``dtype=`` among ``kwargs``). Checked on torch 2.13-2.15."""
    import torch

    return attribute(torch, "_foreach_norm", "foreach_norm", "torch")(tensors, ord, **kwargs)


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """``torch.autograd.Variable._execution_engine.queue_callback``: run ``callback`` once the running backward has
    finished (every gradient accumulated); callable only from inside a backward (a hook). What DDP and FSDP use to
    reduce after the last gradient. Checked on torch 2.13-2.15."""
    import torch

    engine = attribute(torch.autograd.Variable, "_execution_engine", "queue_backward_callback", "torch")
    attribute(engine, "queue_callback", "queue_backward_callback", "torch")(callback)


def current_graph_task_id() -> int:
    """``torch._C._current_graph_task_id()``: the id of the backward running on this thread (a new one per
    ``backward()``), -1 outside one. Checked on torch 2.13-2.15."""
    import torch

    return attribute(torch._C, "_current_graph_task_id", "current_graph_task_id", "torch")()


# The op namespaces of torch's collectives as a dispatch mode sees them: ``torch.distributed`` calls (``c10d``) and
# the functional collectives DTensor issues (native and autograd). Checked on torch 2.13-2.15.
COLLECTIVE_OP_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})


def torch_dispatch_mode() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: the base class of modes that see every op dispatched below
    autograd (collectives included: what ``CommDebugMode`` derives from). Checked on torch 2.13-2.15."""
    return module_attribute("torch.utils._python_dispatch", "TorchDispatchMode", "torch_dispatch_mode", "torch")


def pytree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """``torch.utils._pytree.tree_flatten``: the leaves of nested lists, tuples and dicts (an op's arguments) and the
    spec whose ``unflatten(leaves)`` rebuilds them. Checked on torch 2.13-2.15."""
    return module_attribute("torch.utils._pytree", "tree_flatten", "pytree_flatten", "torch")(tree)


def wait_functional_collective(tensor: torch.Tensor) -> torch.Tensor:
    """``torch.ops._c10d_functional.wait_tensor``: wait for the functional collective (DTensor's) that produces
    ``tensor``; the tensor itself when none is pending. Checked on torch 2.13-2.15."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the op)

    ops = attribute(torch.ops, "_c10d_functional", "wait_functional_collective", "torch")
    return attribute(ops, "wait_tensor", "wait_functional_collective", "torch")(tensor)


def dtensor_local(tensor: Any) -> torch.Tensor:
    """``DTensor._local_tensor``: the local shard itself, outside autograd (``to_local()`` records a graph node).
    Checked on torch 2.13-2.15."""
    return attribute(tensor, "_local_tensor", "dtensor_local", "torch")


def strided_shard_type() -> type:
    """``torch.distributed.tensor.placement_types._StridedShard``: the placement FSDP x TP layouts use (not a
    ``Shard`` subclass in 2.13-2.15). Checked on torch 2.13-2.15."""
    return module_attribute("torch.distributed.tensor.placement_types", "_StridedShard", "strided_shard_type", "torch")


def compute_local_shape_and_global_offset(global_shape: Any, mesh_shape: Any, coordinate: list[int],
                                          placements: Sequence[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``: the shape and offset of the
    piece the rank at ``coordinate`` holds. Checked on torch 2.13-2.15."""
    return module_attribute("torch.distributed.tensor._utils", "_compute_local_shape_and_global_offset",
                             "compute_local_shape_and_global_offset", "torch")(
        global_shape, mesh_shape, coordinate, placements)


def fsdp_param_groups(module: torch.nn.Module) -> list[Any]:
    """``FSDPModule._get_fsdp_state()._fsdp_param_groups``: the parameter groups (mesh info, reduction settings)
    of a module ``fully_shard`` wrapped. Checked on torch 2.13-2.15."""
    state = attribute(module, "_get_fsdp_state", "fsdp_param_groups", "torch")()
    groups = attribute(state, "_fsdp_param_groups", "fsdp_param_groups", "torch")
    return list(groups) if groups is not None else []


def fsdp_lazy_init(module: torch.nn.Module) -> None:
    """``FSDPModule._get_fsdp_state()._lazy_init()``: what FSDP2 does at the first forward it sees, made the root
    of every unit inside ``module`` (a no-op once done). A unit whose forward runs first otherwise takes the root
    role for itself, and the real root's first forward then raises. Checked on torch 2.13-2.15."""
    state = attribute(module, "_get_fsdp_state", "fsdp_lazy_init", "torch")()
    attribute(state, "_lazy_init", "fsdp_lazy_init", "torch")()


def fsdp_group_syncs_gradients(group: Any) -> bool:
    """``FSDPParamGroup.reduce_grads``: False while gradient reduction waits (``set_requires_gradient_sync(False)``,
    FSDP2's ``no_sync`` under accumulation), True in the micro-batch that reduces. Checked on torch 2.13-2.15."""
    return bool(attribute(group, "reduce_grads", "fsdp_group_syncs_gradients", "torch"))


def fsdp_managed_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters ``fully_shard`` manages in ``module``'s own parameter groups, as registered on their modules
    now (``FSDPParam._module_info``: the module and name; its ``sharded_param`` is stale until FSDP's lazy init when
    the parameter was replaced after ``fully_shard``, as transformers' load does). Parameters added later (LoRA
    factors) are not among them. Checked on torch 2.13-2.15."""
    params = []
    for group in fsdp_param_groups(module):
        for fsdp_param in attribute(group, "fsdp_params", "fsdp_managed_parameters", "torch"):
            info = attribute(fsdp_param, "_module_info", "fsdp_managed_parameters", "torch")
            params.append(getattr(info.module, info.param_name))
    return params


def accelerator_type() -> str:
    """``torch._C._get_accelerator().type``: the current accelerator's device type, ``"cpu"`` without one (where
    ``torch.accelerator.current_accelerator()`` returns None). Checked on torch 2.13-2.15."""
    import torch

    return attribute(torch._C, "_get_accelerator", "accelerator_type", "torch")().type


def module_backward_hooks(module: torch.nn.Module) -> dict[int, Callable[..., Any]]:
    """``nn.Module._backward_hooks``: handle id -> hook of ``register_full_backward_hook`` (mutable: deleting a key
    removes the hook). Checked on torch 2.13-2.15."""
    return attribute(module, "_backward_hooks", "module_backward_hooks", "torch")


def module_forward_pre_hooks(module: torch.nn.Module) -> dict[int, Callable[..., Any]]:
    """``nn.Module._forward_pre_hooks``: handle id -> hook of ``register_forward_pre_hook`` (mutable: deleting the
    key of a hook registered without ``with_kwargs`` removes it). Checked on torch 2.13-2.15."""
    return attribute(module, "_forward_pre_hooks", "module_forward_pre_hooks", "torch")


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> dict[int, Callable[..., Any]]:
    """``Tensor._post_accumulate_grad_hooks``: handle id -> hook of ``register_post_accumulate_grad_hook``
    (mutable); empty when none was registered (upstream leaves it None). Checked on torch 2.13-2.15."""
    hooks = attribute(tensor, "_post_accumulate_grad_hooks", "post_accumulate_grad_hooks", "torch")
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
    module_attribute("torch.distributed.tensor.debug", "_clear_sharding_prop_cache",
                      "clear_sharding_propagation_caches", "torch")()
