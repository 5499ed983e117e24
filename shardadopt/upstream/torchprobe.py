"""What the installed torch does where shardadopt has a workaround: probed by behaviour, never by version string.

Each probe runs a few tiny tensor operations once per process (cached) and answers whether torch still behaves
the way that made the workaround necessary. The workarounds themselves stay on whatever the answer is (each is
cheap and correct on every torch), so a probe never changes results; it tells ``shardadopt doctor``, the test
suite (once per torch in CI) and ``benchmarks/gpu_check.py`` (on CUDA) when a torch release has fixed one, and
the workaround can go. Measured on torch 2.13.0 (CPU build) and 2.15.0 (CUDA build on CPU): all three hold.

A probe answers, it never raises: when the probed call itself fails (fused AdamW refuses a strided CUDA parameter
on torch 2.11: "params, grads, exp_avgs, and exp_avg_sqs must have same dtype, device, and layout") the answer is
"not fixed" (the workaround stays on) and :func:`report` gives the exception as the row's ``reason``.

- fused AdamW mis-updates a non-contiguous parameter (a strided view) whose gradient is contiguous: the kernel
  pairs them element by element (CPU: off by up to 2x the learning rate). Workaround: plain shards get their own
  contiguous storage before the optimizer is built (:func:`shardadopt.parallel.optimizer_ready.make_shards_contiguous`).
- ``_StridedShard`` is not a subclass of ``Shard``, so ``isinstance(p, Shard)`` misses it. Workaround: layouts
  test both classes (:func:`shardadopt.gradnorm.layout.count_shards`).
- the inf-norm of an empty tensor raises (``linalg.vector_norm``/``_foreach_norm``: "cannot compute the inf norm
  on an empty tensor"), which uneven shards hit through ``get_total_norm``. Workaround: empty pieces are left
  out of the norm, where they add nothing (:func:`shardadopt.gradnorm.core.local_payload`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TypeVar

import torch

from shardadopt import upstream

__all__ = ["fused_adamw_strided_ok", "strided_shard_is_shard", "inf_norm_accepts_empty", "report"]

_Probe = TypeVar("_Probe", bound=Callable[..., bool])
# Why a probe answered "not fixed" without deciding: (probe name, its arguments) -> the exception it caught.
_FAILURES: dict[tuple[str, tuple[object, ...]], str] = {}


def _answers(probe: _Probe) -> _Probe:
    """Cache ``probe`` and turn an exception from the probed call into "not fixed", remembering the reason."""
    @functools.cache
    def guarded(*args: object) -> bool:
        try:
            return probe(*args)
        except Exception as exc:  # the probed torch call itself failed: the workaround is needed all the more
            _FAILURES[(probe.__name__, args)] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            return False

    return functools.wraps(probe)(guarded)  # type: ignore[return-value]


@_answers
def fused_adamw_strided_ok(device: str = "cpu") -> bool:
    """Whether one fused AdamW step on a strided-view parameter on ``device`` equals the single-tensor step."""
    def step(fused: bool) -> torch.Tensor:
        base = torch.arange(64.0, device=device).reshape(8, 8).sin()
        param = torch.nn.Parameter(base[:, 4:])  # a column shard: a non-contiguous view
        optimizer = torch.optim.AdamW([param], lr=1e-2, **({"fused": True} if fused else {"foreach": False}))
        (param * torch.arange(32.0, device=device).reshape(8, 4).cos()).sum().backward()
        optimizer.step()
        return param.detach().cpu()

    # A mis-update is off by about the learning rate; fused kernels may differ from the loop in the last bits.
    return torch.allclose(step(fused=True), step(fused=False), rtol=1e-5, atol=1e-6)


@_answers
def strided_shard_is_shard() -> bool:
    """Whether ``_StridedShard`` placements are ``Shard`` instances."""
    from torch.distributed.tensor.placement_types import Shard

    return issubclass(upstream.strided_shard_type(), Shard)


@_answers
def inf_norm_accepts_empty() -> bool:
    """Whether ``torch.nn.utils.get_total_norm`` of order inf accepts an empty tensor among its inputs."""
    try:
        torch.nn.utils.get_total_norm([torch.ones(2), torch.empty(0)], norm_type=math.inf)
    except RuntimeError:
        return False
    return True


def report(devices: tuple[str, ...] = ("cpu",)) -> list[dict[str, str | bool]]:
    """One row per probe: ``name``, ``fixed`` (torch no longer needs the workaround), ``workaround`` and ``reason``
    (empty, or the exception the probed call raised: then ``fixed`` is False)."""
    checks: list[tuple[str, Callable[..., bool], tuple[str, ...], str]] = [
        (f"fused AdamW on strided {device} parameters", fused_adamw_strided_ok, (device,),
         "plain shards made contiguous before the optimizer is built") for device in devices]
    checks.append(("_StridedShard is a Shard", strided_shard_is_shard, (), "layouts test Shard and _StridedShard"))
    checks.append(("inf-norm of an empty shard", inf_norm_accepts_empty, (), "empty pieces left out of the norm"))
    return [{"name": name, "fixed": probe(*args), "workaround": workaround,
             "reason": _FAILURES.get((probe.__name__, args), "")} for name, probe, args, workaround in checks]
