"""TP style ``replicated_with_grad_allreduce``: all-reduce each backward's new gradient, not the accumulated ``.grad``.

Upstream: not reported yet (anticipates a transformers fix; the diffs are
upstream-fixes/transformers-tp-replicated-grad-accumulation@<release>.diff, one per upstream layout). The style keeps a
parameter whole on every TP rank while each rank's gradient covers only its own heads (Qwen3 / Qwen3-MoE / Gemma3 /
... ``q_norm``/``k_norm``). transformers 5.21 and later (``transformers/distributed/tensor_parallel.py``,
``ReplicatedWithGradAllReduce.install_forward``) sums the *accumulated* gradient after every backward::

    def _all_reduce_grad(param):
        dist.all_reduce(param.grad, group=mesh.get_group())
    ...
    param.register_post_accumulate_grad_hook(_all_reduce_grad)

and 5.15 (``integrations/tensor_parallel.py``, ``prepare_module_tp``: ``all_reduce_forward(param.grad, mesh)``)
and 5.16 .. 5.20 (``install_forward``: ``dist.all_reduce(param.grad, ...)``) do the same from a module full
backward hook. Without gradient accumulation that is right; with it, each backward sums the earlier micro-batches'
already-summed gradient again (2 micro-batches on a tiny Qwen3: q_norm/k_norm gradients 58-110 % off; Trainer's
grad_norm off from step 1). The fix reduces the gradient flowing into the parameter instead (a tensor hook, before
accumulation): :func:`shardadopt.parallel.tp.install_replicated_grad_allreduce` replaces upstream's installer.

The hook is installed while ``from_pretrained`` applies the TP plan, so ``shardadopt.enable()`` must run before the
model is loaded; for a model loaded earlier, call ``shardadopt.fix_tp_grad_accumulation(model)`` on every rank.
Models without tensor parallelism never reach this style.
"""

from __future__ import annotations

import importlib
import threading

from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.probing import package_file
from shardadopt.upstream.versions import supported


def _layout() -> tuple[str, str]:
    """(module, method) through which the installed transformers hooks the style, found without importing it:
    5.16 moved TP into ``transformers/distributed/tensor_parallel.py`` (``integrations.tensor_parallel`` only
    re-exports it, and loading no longer imports that) and renamed ``prepare_module_tp`` to ``install_forward``."""
    if package_file("transformers", "__init__.py") and not package_file("transformers", "distributed",
                                                                         "tensor_parallel.py"):
        return "transformers.integrations.tensor_parallel", "prepare_module_tp"
    return "transformers.distributed.tensor_parallel", "install_forward"


MODULE, METHOD = _layout()


class _ProbeMesh:
    """Rank 0 of a 2-rank TP mesh; its all-reduce is simulated (see :func:`probe`)."""

    ndim = 1

    def size(self) -> int:
        return 2

    def get_local_rank(self) -> int:
        return 0

    def get_group(self):
        return _PROBE_GROUP


_PROBE_GROUP = object()
_PROBE_LOCK = threading.Lock()


def probe() -> Probe:
    """Run upstream's installer on a one-parameter module, accumulate two backwards with a simulated 2-rank SUM
    all-reduce (the other rank contributes the same gradient, so a sum doubles), and compare with each
    backward's gradient reduced once."""
    import torch
    import torch.distributed as dist

    from shardadopt.upstream.probing import Undecided, upstream_function

    where = "transformers-tp-replicated-grad-accumulation probe"
    style = upstream_function(importlib.import_module(MODULE), "ReplicatedWithGradAllReduce", where)
    upstream_function(style, METHOD, where)

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.weight

    calls = []

    def simulated_all_reduce(tensor, op=None, group=None, async_op=False):
        if group is not _PROBE_GROUP:
            raise RuntimeError("the probe's simulated all-reduce saw a real process group")
        calls.append(tensor)
        tensor.mul_(2)

    module = Scale()
    getattr(style(), METHOD)(module, _ProbeMesh())
    inputs = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])]
    with _PROBE_LOCK:
        real, dist.all_reduce = dist.all_reduce, simulated_all_reduce
        try:
            with torch.enable_grad():
                for x in inputs:
                    module(x.requires_grad_()).sum().backward()
        finally:
            dist.all_reduce = real
    grad = module.weight.grad
    once = 2 * (inputs[0] + inputs[1])  # each backward's gradient summed over the two ranks once
    again = 2 * (2 * inputs[0] + inputs[1])  # the accumulated .grad summed after each backward
    if calls and grad is not None and torch.equal(grad, once):
        return Probe(False, "replicated_with_grad_allreduce reduces each backward's gradient once")
    if calls and grad is not None and torch.equal(grad, again):
        return Probe(True, "replicated_with_grad_allreduce all-reduces the accumulated .grad after every backward, so "
                           "with gradient accumulation earlier micro-batches are summed over the TP group again "
                           f"(probe: {grad.tolist()} for {once.tolist()})")
    raise Undecided(f"{where}: replicated_with_grad_allreduce gave {grad.tolist() if grad is not None else None} over "
                    f"two backwards ({len(calls)} torch.distributed.all_reduce calls): neither each gradient reduced "
                    f"once ({once.tolist()}) nor the accumulated one reduced again ({again.tolist()})")


def _install(wrapped, instance, args, kwargs):
    from shardadopt.parallel.tp import install_replicated_grad_allreduce

    bound = dict(zip(("module", "mesh"), args)) | kwargs
    module = bound["module"]
    mesh = bound.get("mesh", bound.get("device_mesh"))
    install_replicated_grad_allreduce(module, mesh)
    return module


def _hooked_by_upstream(model, layout) -> bool:
    """A model carrying upstream's replicated_with_grad_allreduce hooks (Qwen3 q_norm/k_norm under TP) needs the fix
    (gradient accumulation would sum earlier micro-batches again)."""
    from shardadopt.parallel.tp import has_upstream_replicated_hooks

    return layout.tp_size > 1 and has_upstream_replicated_hooks(model)



PATCH = Patch(
    id="transformers-tp-replicated-grad-accumulation",
    summary="TP replicated_with_grad_allreduce (Qwen3 q_norm/k_norm): reduce each backward's gradient once, so "
            "gradient accumulation is right",
    upstream="anticipates a transformers fix (not reported yet)",
    requires=supported("transformers"),
    wrappers={Target(MODULE, f"ReplicatedWithGradAllReduce.{METHOD}"): _install},
    needed_by=_hooked_by_upstream,
    probe=probe,
)
