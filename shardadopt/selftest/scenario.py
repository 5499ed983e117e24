"""What a selftest scenario is: the function every rank runs, its one-process reference, and how they compare.

The scenario modules (``loading``, ``accelerate``, ``trainer``, ``hpo``, ``checkpoint``) define them and
``shardadopt.selftest.run_selftest`` runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Context:
    """What every scenario gets: the tiny checkpoints (family -> path), the world size and the device."""

    models: dict[str, str]
    nproc: int
    device: str


@dataclass(frozen=True)
class Scenario:
    """One capability checked on ``nproc`` ranks against a one-process reference."""

    name: str
    description: str
    # Module-level function run on every rank: run(ctx) -> result (rank 0's is compared).
    run: Callable[[Context], Any]
    # Single-process reference, run in the launcher: reference(ctx) -> expected.
    reference: Callable[[Context], Any]
    # compare(result, expected) -> None when they agree, else a message saying what differs.
    compare: Callable[[Any, Any], str | None]
    # Why the scenario cannot run with this world size, or None.
    unsupported: Callable[[int], str | None] = lambda nproc: None
