"""A job that ``torchrun --max-restarts`` restarts comes back: each attempt's process groups get keys of their own.

torchrun's agent keeps one TCPStore for the whole job and hands every attempt's workers a client of it
(``TORCHELASTIC_USE_AGENT_STORE``); ``torch.distributed.rendezvous._create_c10d_store`` returns that client with no
per-attempt prefix (torch 2.13 .. 2.15)::

    if _torchelastic_use_agent_store():          # 2.15: _agent_store_serves(hostname, port)
        # We create a new TCPStore for every retry so no need to add prefix for each attempt.
        return TCPStore(host_name=hostname, port=port, world_size=world_size, is_master=False, timeout=timeout)

so a restarted attempt reads the addresses the dead one published: gloo gets "connection refused" from the old port
or hangs, NCCL gets the old unique id (pytorch/pytorch#135712, #167288). The wrapper of the ``rendezvous`` that
``init_process_group`` calls puts the default group's store under a prefix of this attempt's own, a number every
rank reads from rank 0 (:mod:`shardadopt.lifecycle.restarts`); every group built later takes its store from there.

The probe reads that branch of ``_create_c10d_store``: a bare ``TCPStore`` returned means ``needed``; a
``PrefixStore`` from a job-wide attempt means ``not-needed``; one keyed by ``TORCHELASTIC_RESTART_COUNT`` (per agent:
nodes disagree after one agent restarted alone, the fix #135712 reverted) is still ``needed``.
"""

from __future__ import annotations

import ast

from shardadopt.patching.contract import Patch, Probe, Target
from shardadopt.upstream.versions import supported

MODULE = "torch.distributed.distributed_c10d"


def probe() -> Probe:
    from shardadopt import upstream
    from shardadopt.upstream.probing import if_chains, names, source_tree, undecided

    where = "torch.distributed.rendezvous's c10d store factory"
    tree = source_tree(upstream.c10d_store_factory())
    for chain in if_chains(tree):
        for test, body in chain:
            if test is None or not names(test) & upstream.AGENT_STORE_CHECKS:
                continue
            returned = [node.value for stmt in body for node in ast.walk(stmt)
                        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call)]
            branch = set().union(*(names(stmt) for stmt in body))
            if any(isinstance(r.func, ast.Name) and r.func.id == "TCPStore" for r in returned):
                return Probe(True, "every torchrun attempt's workers share the agent's store with no per-attempt "
                                   "prefix: a restarted attempt reads the dead attempt's addresses")
            if "PrefixStore" in branch and "TORCHELASTIC_RESTART_COUNT" in branch:
                return Probe(True, "the agent's store is prefixed by TORCHELASTIC_RESTART_COUNT, which is per agent: "
                                   "nodes disagree once one agent restarted alone")
            if "PrefixStore" in branch:
                return Probe(False, "torch prefixes the agent's store per attempt itself")
    raise undecided(where, "the agent-store branch returning a bare TCPStore (the unfixed shape) nor one returning "
                           "a per-attempt PrefixStore (the fix)")


def _rendezvous(wrapped, instance, args, kwargs):
    from shardadopt.lifecycle.restarts import separate_attempts

    for store, rank, world_size in wrapped(*args, **kwargs):
        yield separate_attempts(store, rank, world_size, kwargs.get("timeout")), rank, world_size


PATCH = Patch(
    id="torch-elastic-attempt-store",
    summary="a job restarted by torchrun --max-restarts resumes: each attempt's process groups (gloo addresses, "
            "NCCL unique ids, every group built later) use keys of their own in the agent's store, the attempt "
            "agreed by every rank of every node",
    upstream="pytorch/pytorch#135712 (closed), #167288 (open)",
    requires=supported("torch"),
    wrappers={Target(MODULE, "rendezvous"): _rendezvous},
    probe=probe,
    probe_modules=("torch.distributed.rendezvous",),
)
