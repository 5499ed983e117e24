"""Each torchrun attempt gets key space of its own in the agent's store, agreed on by every rank of every node.

torchrun's agent hosts one TCPStore for the whole job and every worker of every attempt is a client of it
(``TORCHELASTIC_USE_AGENT_STORE``), with no per-attempt prefix: a restarted attempt's ``init_process_group`` reads
the addresses the dead attempt's ranks published (gloo: "connection refused" from attempt 0's port, or a hang;
NCCL: the old unique id, pytorch/pytorch#167288). Every process group the job ever builds takes its keys from the
default group's store (``new_group``, device meshes, NCCL's unique-id exchange, shardadopt's fence and HPO control
groups), so one prefix under that store separates the attempts.

The prefix is an attempt number every rank reads from rank 0, not ``TORCHELASTIC_RESTART_COUNT``: that counter is
per agent, and a node whose agent restarted alone disagrees with the others. Rank 0 takes the next number from a
counter in the store; every other rank asks under a fresh random token and waits for rank 0's answer under that
token, so no rank can read an answer an earlier attempt left behind; rank 0 answers until each rank has acknowledged
this number. Every rank also reads the job's id, drawn once per job and kept in the agent's store, so code that
outlives an attempt (an HPO study in a database) can tell this job's earlier attempts from other jobs (``current()``).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

NAMESPACE = "shardadopt-attempt"
_POLL = 0.02  # seconds between rank 0's reads of the ranks' questions
_AGREED: list[int] = []  # the attempt number this process agreed on, once it has
_JOB: list[str] = []  # the job's id, read from the agent's store with the attempt


@dataclass(frozen=True)
class Attempt:
    """This torchrun attempt: ``number`` counts the job's attempts from 1, the same on every rank and node;
    ``job`` names the job (the same in every attempt, different for every other job)."""

    number: int
    job: str

    @property
    def restarted(self) -> bool:
        """Whether an earlier attempt of this job ran (and ended) before this one."""
        return self.number > 1


def current() -> Attempt | None:
    """This process's torchrun attempt, or None outside torchrun's shared agent store (or before
    ``init_process_group``, or with the ``torch-elastic-attempt-store`` patch off).

    Returns:
        The attempt, once the default process group was set up on the agent's store.
    """
    return Attempt(_AGREED[0], _JOB[0]) if _AGREED and _JOB else None


def job_id(store: Any) -> str:
    """The job's id in the agent's ``store``: the first rank of the first attempt to ask draws it, every later
    question (any rank, any attempt) reads it (an atomic compare-and-set, so concurrent ranks agree)."""
    return store.compare_set(f"{NAMESPACE}/job", "", uuid.uuid4().hex).decode()


def agent_store(store: Any) -> bool:
    """Whether ``store`` is a client of the torchrun agent's store, the one that outlives the workers' attempts."""
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and isinstance(store, dist.TCPStore)
            and str(store.port) == os.environ.get("MASTER_PORT"))


def agree_on_attempt(store: Any, rank: int, world_size: int, timeout: timedelta) -> int:
    """The number of this attempt, the same on every rank: rank 0 draws it, the others read it from rank 0.

    Args:
        store: the agent's store (unprefixed), shared by every attempt.
        rank: this process's global rank.
        world_size: the number of ranks in this attempt.
        timeout: how long to wait for the other ranks.

    Returns:
        A number no earlier attempt of this job used.
    """
    if rank != 0:
        token = uuid.uuid4().hex
        store.set(f"{NAMESPACE}/ask/{rank}", token)
        attempt = int(store.get(f"{NAMESPACE}/answer/{token}"))  # waits up to the store's timeout
        store.set(f"{NAMESPACE}/got/{attempt}/{rank}", "1")
        return attempt
    attempt = store.add(f"{NAMESPACE}/counter", 1)
    pending, answered = set(range(1, world_size)), set()
    deadline = time.monotonic() + timeout.total_seconds()
    while pending:
        for peer in sorted(pending):
            if store.check([f"{NAMESPACE}/got/{attempt}/{peer}"]):
                pending.discard(peer)
            elif store.check([f"{NAMESPACE}/ask/{peer}"]):
                token = store.get(f"{NAMESPACE}/ask/{peer}").decode()
                if token not in answered:  # perhaps an earlier attempt's question: its answer is never read
                    store.set(f"{NAMESPACE}/answer/{token}", str(attempt))
                    answered.add(token)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"torchrun attempt {attempt}: ranks {sorted(pending)} did not join within "
                               f"{timeout.total_seconds():.0f} s (init_process_group's timeout)")
        if pending:
            time.sleep(_POLL)
    return attempt


def separate_attempts(store: Any, rank: int, world_size: int, timeout: timedelta | None) -> Any:
    """``store`` under this attempt's own prefix when it is the torchrun agent's store; else ``store`` itself.

    Args:
        store: the store a rendezvous returned.
        rank: this process's global rank.
        world_size: the number of ranks.
        timeout: the process group's timeout (None: torch's default).

    Returns:
        The store the default process group should use.
    """
    if not agent_store(store):
        return store
    attempt = agree_on_attempt(store, rank, world_size, timeout or timedelta(minutes=10))
    _AGREED[:], _JOB[:] = [attempt], [job_id(store)]
    return dist.PrefixStore(f"{NAMESPACE}/{attempt}/", store)


def attempt_tag() -> str:
    """What names this attempt in keys written to the agent's store outside the default group's prefix (the fence's
    records, a rebuilt world): the agreed attempt number, else torchrun's run id and per-agent restart count."""
    if _AGREED:
        return f"{NAMESPACE}-{_AGREED[0]}"
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
