"""A job that shards a model while loading exits 0 on every rank when it succeeds (no SIGABRT at interpreter exit).

``from_pretrained(..., distributed_config=...)`` initialises torch.distributed where nobody did
(``_ensure_torch_distributed``) and builds device meshes whose process groups nothing destroys; on gloo their worker
threads may still have to drop a tensor, which takes the GIL, when the interpreter begins finalising, and CPython
ends such a thread mid-destructor: ``terminate called without an active exception``, SIGABRT on one rank, and
torchrun SIGTERMs the others (measured: ``benchmarks/clean_exit.py``). See :mod:`shardadopt.lifecycle.cleanexit` for why
``destroy_process_group`` alone does not help and why NCCL groups are left alone.

``DistributedMixin.maybe_distribute_model`` (``transformers/distributed/mixin.py``) receives the mesh of every
sharded load (5.15 .. 5.17: ``device_mesh``, 5.18+: ``mesh_manager``) and returns at once without one::

    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        if mesh_manager is None:
            return model

The wrapper arms :func:`shardadopt.lifecycle.cleanexit.arm_at_exit` after a load that got a mesh, so only processes that
sharded a model at load time change at exit, and only when they exit without an uncaught exception. Plain models,
plain DDP runs and failing ranks exit exactly as upstream.

The probe reads torch's ``torch.distributed.distributed_c10d`` syntax tree: no ``atexit.register`` there (torch
2.13 .. 2.15) means ``needed``; one that calls ``destroy_process_group`` (as pytorch/pytorch#157193 / #179291
proposed) means ``not-needed``; any other ``atexit`` registration is a shape the probe does not know (``unsupported``).
"""

from __future__ import annotations

import inspect

from shardadopt import upstream
from shardadopt.patching.contract import Patch, Probe
from shardadopt.upstream.versions import supported


def probe() -> Probe:
    import ast

    from torch.distributed import distributed_c10d

    from shardadopt.upstream.probing import calls, undecided, upstream_function

    where = "torch.distributed.distributed_c10d"
    upstream_function(distributed_c10d, "destroy_process_group", where)
    source = inspect.getsource(distributed_c10d)
    # a module that never names atexit registers nothing there: no need to parse its 6k lines on every rank
    registered = [call for call in calls(ast.parse(source), "register")
                  if isinstance(call.func, ast.Attribute) and getattr(call.func.value, "id", None) == "atexit"
                  ] if "atexit" in source else []
    if any("destroy_process_group" in ast.unparse(call) for call in registered):
        return Probe(False, "torch.distributed tears process groups down at interpreter exit itself")
    if not registered:
        return Probe(True, "nothing destroys the process groups of a model sharded at load time before interpreter "
                           "finalisation; gloo worker threads can abort the process at exit (SIGABRT)")
    raise undecided(where, "no atexit registration (the unfixed shape) nor one that calls destroy_process_group "
                           "(the fix)")


def _maybe_distribute_model(wrapped, instance, args, kwargs):
    from shardadopt.lifecycle.cleanexit import arm_at_exit

    call = upstream.bind_maybe_distribute_model(wrapped, args, kwargs)
    model = wrapped(*args, **kwargs)
    if call.shards:
        arm_at_exit()
    return model


PATCH = Patch(
    id="transformers-sharded-clean-exit",
    summary="a job that sharded a model while loading exits 0 on every rank when it succeeds (gloo threads drained, "
            "gloo groups destroyed at a successful exit)",
    upstream="pytorch/pytorch#179291 (abandoned: atexit destroy_process_group); not reported to transformers",
    requires=supported("transformers"),
    wrappers={upstream.MAYBE_DISTRIBUTE_MODEL: _maybe_distribute_model},
    probe=probe,
    probe_modules=("torch.distributed.distributed_c10d",),
)
