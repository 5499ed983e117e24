"""torch's ring attention (context parallelism) serves the CPU flash SDPA kernel as it serves the CUDA ones.

``torch.distributed.tensor.experimental.context_parallel`` shards q/k/v on the sequence and hands each SDPA kernel
it knows to a DTensor handler that runs the kernel once per key/value block passed round the ring, merging the
outputs by their log-sum-exp (``_templated_ring_attention`` and its backward). torch 2.13-2.15 list only the CUDA
kernels (flash, efficient, cuDNN); on CPU, SDPA picks ``aten._scaled_dot_product_flash_attention_for_cpu``, which
returns the same (output, log-sum-exp) pair in the same layout, and the first forward raised ``NotImplementedError:
... does not have a sharding strategy registered``. While context parallelism is on, this module adds the CPU kernel
and its backward to the same templated ring code with the same sequence-sharded strategy, and takes them out again
when it is off (:func:`install`, :func:`uninstall`), so CPU runs exercise the code GPUs run.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from shardadopt import upstream

__all__ = ["CPU_FLASH", "CPU_FLASH_BACKWARD", "install", "uninstall"]

CPU_FLASH = upstream.sdpa_flash_kernels()["cpu"]
CPU_FLASH_BACKWARD = upstream.sdpa_flash_kernels()["cpu_backward"]
_SEQ_DIM = 2  # q, k, v, output: [batch, heads, sequence, head_dim]; log-sum-exp: [batch, heads, sequence]

_installed: list[AbstractContextManager[Any]] = []


def _ring_forward(mesh: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                  is_causal: bool = False, *, attn_mask: torch.Tensor | None = None,
                  scale: float | None = None) -> tuple[torch.Tensor, ...]:
    if attn_mask is not None:
        raise NotImplementedError("context parallelism on CPU: attn_mask is not supported (ring attention merges "
                                  "causal or unmasked blocks only)")
    return upstream.cp_templated_ring_attention()(
        mesh.get_group(), _SEQ_DIM, CPU_FLASH, query=query, key=key,
        value=value, is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _ring_backward(mesh: Any, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   out: torch.Tensor, logsumexp: torch.Tensor, dropout_p: float, is_causal: bool, *,
                   attn_mask: torch.Tensor | None = None, scale: float | None = None) -> tuple[torch.Tensor, ...]:
    if attn_mask is not None:
        raise NotImplementedError("context parallelism on CPU: attn_mask is not supported")
    return upstream.cp_templated_ring_attention_backward()(
        mesh.get_group(), _SEQ_DIM, CPU_FLASH_BACKWARD, grad_out=grad_out, grad_out_name="grad_out", query=query,
        key=key, value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)


_RING = {CPU_FLASH: _ring_forward, CPU_FLASH_BACKWARD: _ring_backward}


def _handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The DTensor handler of the CPU kernels under context parallelism: upstream's ``_sdpa_handler`` for them."""
    dispatcher = upstream.dtensor_op_dispatcher()
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    output_sharding = op_info.output_sharding
    if output_sharding is None or output_sharding.needs_redistribute:
        raise NotImplementedError(f"context parallelism: {op_call} needs q, k and v sharded on the sequence "
                                  f"(dim {_SEQ_DIM}) of one mesh")
    local = _RING[op_call](op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local, output_sharding.output_spec)


def _placements(count: int) -> list[Any]:
    from torch.distributed.tensor import Shard

    return [Shard(_SEQ_DIM)] * count


def _forward_strategy(*args: Any) -> Any:
    # outputs (output, log-sum-exp), then inputs (q, k, v): all sharded on the sequence
    if upstream.cp_single_dim_strategies():
        return [[upstream.sharding_placeholder(_SEQ_DIM)] * 5]
    (op_schema,) = args
    return upstream.expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, [_placements(5)],
                                                    input_index=2)


def _backward_strategy(*args: Any) -> Any:
    # outputs (grad q, k, v), then inputs (grad_out, q, k, v, out, log-sum-exp)
    if upstream.cp_single_dim_strategies():
        return [[upstream.sharding_placeholder(_SEQ_DIM)] * 9]
    (op_schema,) = args
    return upstream.expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False), op_schema,
                                                    [_placements(9)], input_index=3)


def install() -> None:
    """Route the CPU flash kernel and its backward through ring attention (call right after torch enabled its
    context-parallel dispatcher): their DTensor handler, and their sequence-sharded strategies."""
    if _installed:
        return
    upstream.set_dtensor_custom_op_handlers({**upstream.dtensor_custom_op_handlers(), CPU_FLASH: _handler,
                                             CPU_FLASH_BACKWARD: _handler})
    for op, strategy in ((CPU_FLASH, _forward_strategy), (CPU_FLASH_BACKWARD, _backward_strategy)):
        context = upstream.cp_strategy_context(op, strategy)
        context.__enter__()
        _installed.append(context)


def uninstall() -> None:
    """Put back the strategies :func:`install` replaced (torch's disable already restored the handlers)."""
    handlers = upstream.dtensor_custom_op_handlers()
    if any(handlers.get(op) is _handler for op in _RING):
        upstream.set_dtensor_custom_op_handlers({op: h for op, h in handlers.items() if h is not _handler})
    while _installed:
        _installed.pop().__exit__(None, None, None)
