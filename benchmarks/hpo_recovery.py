"""Time to recover from a fault on one rank, per fault point, in ``shardadopt.hpo.optimize`` on gloo ranks.

    python benchmarks/hpo_recovery.py [--ranks 2] [--repeats 3] [--points model_init data forward ...]

The objective of ``tests/hpo/test_hpo_faults.py`` (``shardadopt.testing.fault_search``: DDP training of a small model on
the default gloo group, the loss all-reduced each step) raises on the last rank at one fault point in trial 0 of a
2-trial study; the control timeout is 600 s (what the peers waited before the fence). Per fault point, the median
over ``--repeats`` of:

- ``leave``: seconds from the fault to the slowest rank starting trial 1 (the failed trial agreed on, recorded as
  FAIL, and the process groups rebuilt);
- ``rebuild``: of that, the seconds ``shardadopt.fence.rebuild_world`` took on rank 0;
- side by side, ``trial``: seconds of one fault-free trial on the same pool (what a fault costs in trial units).

Ranks share the machine's cores with everything else running: compare numbers from one run only.
"""

from __future__ import annotations

import argparse
import statistics
import time

from shardadopt.testing import fault_search


def _timed_search(fault: dict | None) -> dict:
    """``fault_search.search`` plus the time rank 0 spent in ``rebuild_world``."""
    from shardadopt import fence

    spent = []
    original = fence.rebuild_world

    def timed() -> None:
        start = time.monotonic()
        original()
        spent.append(time.monotonic() - start)

    fence.rebuild_world = timed  # measurement only: the benchmark's own wrapper around the public function
    try:
        result = fault_search.search(fault, (fault_search.InjectedFault,))
    finally:
        fence.rebuild_world = original
    result["rebuild"] = sum(spent)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--points", nargs="+", default=None)
    args = parser.parse_args()

    from shardadopt.testing import RankPool

    points = args.points or list(fault_search.POINTS)
    failing = args.ranks - 1
    print(f"{args.ranks} gloo ranks, fault on rank {failing} at step 2 of trial 0, control timeout "
          f"{fault_search.CONTROL_TIMEOUT:.0f}s, median of {args.repeats}")
    print(f"{'fault point':<12} {'leave s':>8} {'rebuild s':>10} {'trial s':>8} {'leave/trial':>12}")
    with RankPool(args.ranks) as pool:
        trial_seconds = []
        for _ in range(args.repeats):
            results = pool.run(_timed_search, None, timeout=300)
            starts = [dict(r["started"]) for r in results]
            trial_seconds.append(max(s[1] - s[0] for s in starts))
        trial = statistics.median(trial_seconds)
        for point in points:
            leave, rebuild = [], []
            for _ in range(args.repeats):
                fault = {"rank": failing, "trial": 0, "point": point, "step": 2}
                results = pool.run(_timed_search, fault, timeout=300)
                fault_at = results[failing]["fault_at"]
                leave.append(max(dict(r["started"])[1] for r in results) - fault_at)
                rebuild.append(results[0]["rebuild"])
            print(f"{point:<12} {statistics.median(leave):>8.2f} {statistics.median(rebuild):>10.2f} "
                  f"{trial:>8.2f} {statistics.median(leave) / trial:>12.2f}")


if __name__ == "__main__":
    main()
