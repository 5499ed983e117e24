"""The hang decision: which ranks are hung, from the beats every rank's hang monitor publishes. A pure function.

A rank whose progress count did not move for ``hang_timeout`` is stalled; ranks blocked in a collective waiting for a
hung peer are stalled too, but they went further first. Once every rank is stalled or silent (its beat stopped for
3 ticks: its Python threads cannot run), the hung ranks are the silent ones, else those with the lowest count when
some rank went further, else, all at the same count, those not waiting in ``torch.distributed`` when some rank is.
Anything else (every rank slow at the same point) is not a hang. The reasoning: ``docs/fence.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

Seen = dict[int, tuple[bytes | None, float]]  # rank -> (its last beat, when it changed, on the deciding rank's clock)


class Beat(NamedTuple):
    """What a rank's hang monitor published: its beat number, progress count, whether it is stalled, and whether its
    main thread waits in ``torch.distributed``."""

    number: int
    count: int
    stalled: bool
    waiting: bool


class Verdict(NamedTuple):
    """The ranks named hung (sorted) and the message their trip records."""

    hung: list[int]
    message: str


def format_beat(beat: Beat) -> str:
    """The text of ``beat`` in the store (``parse_beat`` reads it back)."""
    return f"{beat.number} {beat.count} {int(beat.stalled)} {int(beat.waiting)}"


def parse_beat(value: bytes) -> Beat:
    """A beat read from the store."""
    number, count, stalled, waiting = (int(x) for x in value.decode().split())
    return Beat(number, count, bool(stalled), bool(waiting))


def decide(rank: int, count: int, in_torch: bool, beats: Sequence[bytes | None], seen: Mapping[int, tuple],
           now: float, tick: float, timeout: float, what: str) -> tuple[Verdict | None, Seen]:
    """Whether the ranks are hung, decided by ``rank``, which is stalled.

    Args:
        rank: the deciding rank.
        count: its progress count.
        in_torch: whether its main thread waits in ``torch.distributed``.
        beats: every rank's last published beat (``format_beat``), by rank; None where none was published yet.
        seen: what the previous decisions of this rank saw (``{}`` at first): each rank's beat and when it changed.
        now: this rank's monotonic clock.
        tick: seconds between two beats; a beat unchanged for 3 ticks is silent.
        timeout: the hang timeout (for the message).
        what: the fenced section (for the message).

    Returns:
        The verdict (None: no hang, or not yet) and what this decision saw, for the next one. Ranks are looked at in
        order and the look stops at the first one that still makes progress (or published nothing yet).
    """
    seen = dict(seen)
    counts, silent, in_torch_by_rank = {rank: count}, [], {rank: in_torch}
    for r, value in enumerate(beats):
        if r == rank:
            continue
        if seen.get(r, (b"", 0.0))[0] != value:
            seen[r] = (value, now)
        if now - seen[r][1] >= 3 * tick:
            silent.append(r)
            continue
        if value is None:
            return None, seen
        theirs = parse_beat(value)
        if not theirs.stalled:
            return None, seen  # rank r still makes progress: whoever it waits for is not hung yet
        counts[r], in_torch_by_rank[r] = theirs.count, theirs.waiting
    lowest = min(counts.values())
    if silent:
        hung = silent
    elif lowest != max(counts.values()):
        hung = sorted(r for r, c in counts.items() if c == lowest)
    else:  # nobody went further: those waiting in torch.distributed (a collective, a rendezvous) wait for the rest
        hung = sorted(r for r, inside in in_torch_by_rank.items() if not inside)
        if len(hung) in (0, len(in_torch_by_rank)):
            return None, seen  # all slow at the same point (an import, a save, every rank in one collective)
    waiting = sorted(set(range(len(beats))) - set(hung))
    how = " and does not answer (blocked outside Python)" if silent else ""
    message = (f"rank(s) {hung} made no progress for {timeout:g}s in {what}{how}"
               + (f"; rank(s) {waiting} waited for them" if waiting else ""))
    return Verdict(hung, message), seen
