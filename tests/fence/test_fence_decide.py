"""The fence's hang decision (``shardadopt.fence.hang_decision.decide``) and its store records, without processes.

The decision is made by a stalled rank from every rank's published beat; these tests hand it beats directly.
"""

from __future__ import annotations

from shardadopt.fence import records
from shardadopt.fence.errors import HANG_KIND
from shardadopt.fence.hang_decision import Beat, Verdict, decide, format_beat, parse_beat
from shardadopt.lifecycle import restarts

TICK = 0.5


def beat(count: int, stalled: bool = True, waiting: bool = False, number: int = 1) -> bytes:
    return format_beat(Beat(number, count, stalled, waiting)).encode()


def decide_as(rank: int, count: int, beats: list[bytes | None], in_torch: bool = False, seen: dict | None = None,
              now: float = 0.0) -> tuple[Verdict | None, dict]:
    return decide(rank, count, in_torch, beats, seen or {}, now, TICK, 10.0, "trial 3")


def test_a_beat_reads_back_as_written():
    assert parse_beat(format_beat(Beat(7, 42, True, False)).encode()) == Beat(7, 42, True, False)
    assert format_beat(Beat(1, 2, False, True)) == "1 2 0 1"


def test_no_hang_while_another_rank_makes_progress():
    verdict, _ = decide_as(0, 5, [None, beat(9, stalled=False)])
    assert verdict is None


def test_no_hang_before_every_rank_published_a_beat():
    verdict, seen = decide_as(0, 5, [None, None])
    assert verdict is None and seen == {1: (None, 0.0)}


def test_the_rank_that_went_least_far_is_hung():
    verdict, _ = decide_as(1, 7, [beat(5), None])
    assert verdict == Verdict([0], "rank(s) [0] made no progress for 10s in trial 3; rank(s) [1] waited for them")


def test_every_rank_at_the_lowest_count_is_hung():
    verdict, _ = decide_as(0, 3, [None, beat(3), beat(8)])
    assert verdict is not None and verdict.hung == [0, 1]
    assert verdict.message.endswith("rank(s) [2] waited for them"), verdict.message


def test_at_the_same_count_the_ranks_outside_torch_distributed_are_hung():
    verdict, _ = decide_as(0, 4, [None, beat(4, waiting=True)], in_torch=False)
    assert verdict is not None and verdict.hung == [0]
    verdict, _ = decide_as(0, 4, [None, beat(4, waiting=False)], in_torch=True)
    assert verdict is not None and verdict.hung == [1]


def test_every_rank_slow_at_the_same_point_is_not_a_hang():
    assert decide_as(0, 4, [None, beat(4, waiting=True)], in_torch=True)[0] is None
    assert decide_as(0, 4, [None, beat(4, waiting=False)], in_torch=False)[0] is None


def test_a_rank_whose_beat_stopped_for_three_ticks_is_silent_and_hung():
    last = beat(9, stalled=False)  # it was making progress when its beat stopped: its Python cannot run
    verdict, _ = decide_as(0, 4, [None, last], seen={1: (last, 0.0)}, now=3 * TICK)
    assert verdict is not None and verdict.hung == [1]
    assert "does not answer (blocked outside Python)" in verdict.message, verdict.message
    assert decide_as(0, 4, [None, last], seen={1: (last, 0.0)}, now=3 * TICK - 0.01)[0] is None


def test_a_rank_that_never_published_is_silent_after_three_ticks():
    verdict, _ = decide_as(0, 4, [None, None], seen={1: (None, 0.0)}, now=3 * TICK)
    assert verdict is not None and verdict.hung == [1]


def test_silent_ranks_win_over_counts():
    last = beat(1)
    verdict, _ = decide_as(0, 4, [None, beat(9), last], seen={2: (last, 0.0)}, now=5.0)
    assert verdict is not None and verdict.hung == [2]


def test_a_changed_beat_is_remembered_with_the_time_it_changed():
    old, new = beat(3, number=1), beat(3, number=2)
    _, seen = decide_as(0, 5, [None, new], seen={1: (old, 0.0)}, now=2.0)
    assert seen == {1: (new, 2.0)}


def test_the_seen_beats_given_are_not_changed():
    given = {1: (beat(3, number=1), 0.0)}
    before = dict(given)
    decide_as(0, 5, [None, beat(3, number=2)], seen=given, now=2.0)
    assert given == before


def test_the_look_stops_at_the_first_rank_still_making_progress():
    """Ranks after it are not looked at: their beats are remembered at the next decision."""
    _, seen = decide_as(0, 5, [None, beat(9, stalled=False), beat(1)], now=1.0)
    assert seen == {1: (beat(9, stalled=False), 1.0)}


# -- trip records -----------------------------------------------------------------------------------------------------


def test_an_error_trip_reads_back_as_written():
    text = records.format_trip(2, records.ERROR_KIND, "RuntimeError: disk full\nsecond line")
    assert text == "2\nerror\nRuntimeError: disk full\nsecond line"
    assert records.parse_trip(text.encode()) == (2, "error", [], "RuntimeError: disk full\nsecond line")


def test_a_hang_trip_names_every_hung_rank():
    text = records.format_trip(1, HANG_KIND, "rank(s) [1, 3] made no progress", [1, 3])
    assert text == "1\nhang:1,3\nrank(s) [1, 3] made no progress"
    assert records.parse_trip(text) == records.Trip(1, HANG_KIND, [1, 3], "rank(s) [1, 3] made no progress")


def test_fence_keys_are_per_torchrun_attempt_and_generation(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert records.trip_key(3) == "shardadopt-fence/job7/2/3/trip"
    assert records.wake_key(3, 5) == "shardadopt-fence/job7/2/3/wake/5"
    # where the torch-elastic-attempt-store patch agreed on a job-wide attempt (restart counts are per agent)
    monkeypatch.setattr(restarts, "_AGREED", [4])
    assert records.trip_key(3) == "shardadopt-fence/shardadopt-attempt-4/3/trip"
