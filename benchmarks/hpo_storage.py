"""Storage round-trip cost per trial: journal file vs PostgreSQL, measured side by side in one run.

One "trial" is what a shardadopt worker's rank 0 does against storage: ask, two suggests, the reproducibility
attributes, a heartbeat, ``reports`` intermediate values and tell. No training: this isolates storage cost.

    python benchmarks/hpo_storage.py [--trials 40] [--reports 8] [--postgres postgresql://postgres@127.0.0.1:5432/test]

Prints the median and p90 milliseconds per trial for each storage and the ratio PostgreSQL / journal.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid

import optuna

from shardadopt.hpo.durability import ATTR_HEARTBEAT
from shardadopt.hpo.provenance import reproducibility_attrs
from shardadopt.hpo.storage import StorageError, resolve_storage


def one_trial(study: optuna.Study, attrs: dict, reports: int) -> float:
    start = time.perf_counter()
    trial = study.ask()
    x = trial.suggest_float("x", -1, 1)
    trial.suggest_int("layers", 1, 4)
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    trial.set_user_attr(ATTR_HEARTBEAT, time.time())
    for step in range(reports):
        trial.report(x * x + 1.0 / (step + 1), step)
        trial.should_prune()
    study.tell(trial, x * x)
    return (time.perf_counter() - start) * 1000


def measure(storage, trials: int, reports: int) -> list[float]:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    study = optuna.create_study(study_name=name, storage=storage, sampler=optuna.samplers.RandomSampler(seed=0),
                                pruner=optuna.pruners.MedianPruner())
    attrs = reproducibility_attrs(space="bench", world_size=2)
    one_trial(study, attrs, reports)  # warm-up: table creation, connection pool
    times = [one_trial(study, attrs, reports) for _ in range(trials)]
    optuna.delete_study(study_name=name, storage=storage)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--reports", type=int, default=8)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["journal"] = measure(resolve_storage(f"journal://{tmp}/bench.log"), args.trials, args.reports)
    try:
        results["postgresql"] = measure(resolve_storage(args.postgres, heartbeat_interval=None), args.trials,
                                        args.reports)
    except StorageError as exc:
        print(f"postgresql skipped: {exc}")
    print(f"{'storage':<12} {'median ms/trial':>16} {'p90 ms/trial':>14}   ({args.trials} trials, "
          f"{args.reports} reports each)")
    for name, times in results.items():
        p90 = statistics.quantiles(times, n=10)[-1]
        print(f"{name:<12} {statistics.median(times):16.2f} {p90:14.2f}")
    if len(results) == 2:
        ratio = statistics.median(results["postgresql"]) / statistics.median(results["journal"])
        print(f"ratio postgresql / journal (median): {ratio:.2f}x")


if __name__ == "__main__":
    main()
