"""torch's private names for context parallelism (ring attention): the ``_context_parallel`` modules and their
kernels, the DTensor dispatcher hooks and sharding strategies ``context_parallel`` installs, and the SDPA kernels it
serves. Apart from ``upstream/torch.py`` because this is the part of torch that moves fastest (2.13 and 2.15 differ
in how strategies are given). Checked on torch 2.13-2.15."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardadopt.upstream.base import Target, attribute, module_attribute

# torch's context parallelism (ring attention): ``torch.distributed.tensor.experimental._context_parallel``.
CP_ATTENTION_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"
CP_SHARDING_RULES_MODULE = "torch.distributed.tensor.experimental._context_parallel._sharding_rules"
# ``_enable_cp_dtensor_dispatcher`` / ``_disable_cp_dtensor_dispatcher``: what ``context_parallel`` calls to install
# (and remove) the DTensor handlers of the SDPA kernels ring attention serves and their sequence-sharded strategies.
# Checked on torch 2.13-2.15.
CP_ENABLE_DISPATCHER = Target(CP_ATTENTION_MODULE, "_enable_cp_dtensor_dispatcher")
CP_DISABLE_DISPATCHER = Target(CP_ATTENTION_MODULE, "_disable_cp_dtensor_dispatcher")


def cp_custom_ops() -> dict[Any, Callable[..., Any]]:
    """``_context_parallel._attention.custom_ops``: the SDPA kernels (ATen overloads) ring attention serves, mapped
    to their DTensor handler (2.13-2.15: the CUDA flash, efficient and cuDNN kernels and their backwards). Checked
    on torch 2.13-2.15."""
    return module_attribute(CP_ATTENTION_MODULE, "custom_ops", "cp_custom_ops", "torch")


def cp_templated_ring_attention() -> Callable[..., Any]:
    """``_context_parallel._attention._templated_ring_attention``: the ring forward around any SDPA kernel that
    returns (output, log-sum-exp, ...). Checked on torch 2.13-2.15."""
    return module_attribute(CP_ATTENTION_MODULE, "_templated_ring_attention", "cp_templated_ring_attention", "torch")


def cp_templated_ring_attention_backward() -> Callable[..., Any]:
    """``_context_parallel._attention._templated_ring_attention_backward``: the ring backward around an SDPA
    backward kernel. Checked on torch 2.13-2.15."""
    return module_attribute(CP_ATTENTION_MODULE, "_templated_ring_attention_backward",
                             "cp_templated_ring_attention_backward", "torch")


def cp_register_sharding_rules() -> Callable[[], None]:
    """``_context_parallel._sharding_rules.register_cp_sharding_rules``: installs the sequence-sharded strategies of
    the kernels ring attention serves (read by probes). Checked on torch 2.13-2.15."""
    return module_attribute(CP_SHARDING_RULES_MODULE, "register_cp_sharding_rules", "cp_register_sharding_rules",
                             "torch")


def cp_strategy_context(op: Any, strategy: Callable[..., Any]) -> Any:
    """A context manager that installs ``strategy`` as DTensor's sharding strategy of ``op`` and puts the one before
    it back on exit: ``_sharding_rules._single_dim_strategy_context`` (torch 2.15: ``strategy(op, args_schema,
    kwargs_schema)`` lists single-mesh-dim placements, ``_ShardingPlaceholder`` for shards) or
    ``_op_strategy_context`` (torch 2.13: ``strategy(op_schema)`` returns an ``OpStrategy``). Checked on torch
    2.13-2.15."""
    import importlib

    rules = importlib.import_module(CP_SHARDING_RULES_MODULE)
    if hasattr(rules, "_single_dim_strategy_context"):
        return rules._single_dim_strategy_context(op, strategy)
    return attribute(rules, "_op_strategy_context", "cp_strategy_context", "torch")(op, strategy)


def cp_single_dim_strategies() -> bool:
    """Whether DTensor takes single-mesh-dim strategies for the context-parallel kernels (torch 2.15's
    ``_single_dim_strategy_context``) rather than whole ``OpStrategy`` functions (2.13). Checked on torch 2.13-2.15."""
    import importlib

    return hasattr(importlib.import_module(CP_SHARDING_RULES_MODULE), "_single_dim_strategy_context")


def sharding_placeholder(dim: int) -> Any:
    """``torch.distributed.tensor._ops.single_dim_strategy._ShardingPlaceholder(dim)``: "sharded on ``dim``" in a
    single-mesh-dim strategy (torch 2.15). Checked on torch 2.15."""
    return module_attribute("torch.distributed.tensor._ops.single_dim_strategy", "_ShardingPlaceholder",
                             "sharding_placeholder", "torch")(dim)


def expand_to_full_mesh_op_strategy(mesh: Any, op_schema: Any, strategies: list[list[Any]], input_index: int) -> Any:
    """``torch.distributed.tensor._ops.utils.expand_to_full_mesh_op_strategy``: an ``OpStrategy`` from placements
    per single mesh dim (outputs first, inputs from ``input_index``) (torch 2.13). Checked on torch 2.13-2.15."""
    return module_attribute("torch.distributed.tensor._ops.utils", "expand_to_full_mesh_op_strategy",
                             "expand_to_full_mesh_op_strategy", "torch")(mesh, op_schema, strategies,
                                                                         input_index=input_index)


def dtensor_op_dispatcher() -> Any:
    """``DTensor._op_dispatcher``: DTensor's operator dispatcher (``unwrap_to_op_info``, ``sharding_propagator``,
    ``wrap``, ``_custom_op_handlers``). Checked on torch 2.13-2.15."""
    from torch.distributed.tensor import DTensor

    return attribute(DTensor, "_op_dispatcher", "dtensor_op_dispatcher", "torch")


def dtensor_custom_op_handlers() -> dict[Any, Callable[..., Any]]:
    """``DTensor._op_dispatcher._custom_op_handlers``: ATen overloads DTensor hands to a handler instead of its
    sharding propagation (context parallelism installs its SDPA handlers there). Checked on torch 2.13-2.15."""
    return attribute(dtensor_op_dispatcher(), "_custom_op_handlers", "dtensor_custom_op_handlers", "torch")


def set_dtensor_custom_op_handlers(handlers: dict[Any, Callable[..., Any]]) -> None:
    """Replace ``DTensor._op_dispatcher._custom_op_handlers`` (as torch's ``_enable_cp_dtensor_dispatcher`` does).
    Checked on torch 2.13-2.15."""
    dtensor_custom_op_handlers()  # the attribute exists
    dtensor_op_dispatcher()._custom_op_handlers = handlers


def sdpa_flash_kernels() -> dict[str, Any]:
    """SDPA's flash kernels (ATen overloads): ``cpu`` (``aten._scaled_dot_product_flash_attention_for_cpu``, what
    ``scaled_dot_product_attention`` runs on CPU), ``cpu_backward`` (its backward) and ``cuda``
    (``aten._scaled_dot_product_flash_attention``). Checked on torch 2.13-2.15."""
    import torch

    aten = torch.ops.aten
    return {"cpu": aten._scaled_dot_product_flash_attention_for_cpu.default,
            "cpu_backward": aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            "cuda": aten._scaled_dot_product_flash_attention.default}


def cp_load_balanced() -> bool:
    """``_context_parallel._attention._cp_options.enable_load_balance``: inside ``context_parallel``, whether the
    buffers were split head-tail (rank ``r`` of ``N`` holds chunks ``r`` and ``2N-1-r`` of ``2N``; torch sets it
    to whether the sequence divides into ``2N`` chunks) rather than in ``N`` contiguous chunks. Checked on torch
    2.13-2.15."""
    return bool(attribute(module_attribute(CP_ATTENTION_MODULE, "_cp_options", "cp_load_balanced", "torch"),
                          "enable_load_balance", "cp_load_balanced", "torch"))
