"""``shardadopt hpo status|requeue|best|export``: look after a study from outside the training jobs.

Once the study's best configurations were re-run with fresh seeds (``shardadopt hpo reseed``), ``status`` and
``best`` rank configurations by their mean over seeds and show the spread and number of seeds.
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections import Counter
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from shardadopt.hpo import commands
from shardadopt.hpo.durability import DEFAULT_GRACE_PERIOD, heartbeat_age, requeue
from shardadopt.hpo.failures import ATTR_KIND, ATTR_RETRY_OF
from shardadopt.hpo.storage import load_study, resolve_storage


def status(study: optuna.Study, now: float | None = None) -> dict[str, Any]:
    trials = study.get_trials(deepcopy=False)
    states = Counter(t.state.name for t in trials)
    kinds = Counter(t.user_attrs.get(ATTR_KIND, "unrecorded") for t in trials if t.state == TrialState.FAIL)
    running = [{"number": t.number, "heartbeat_age_s": _round(heartbeat_age(t, now)),
                "host": t.user_attrs.get("host"), "pid": t.user_attrs.get("pid")}
               for t in trials if t.state == TrialState.RUNNING]
    return {"study": study.study_name, "trials": len(trials), "states": dict(states), "failure_kinds": dict(kinds),
            "running": running, "best": [_trial_row(t) for t in best(study, 1)]}


def best(study: optuna.Study, top: int = 1) -> list[FrozenTrial]:
    """The ``top`` completed trials (single objective), or the Pareto front (multi-objective)."""
    if len(study.directions) > 1:
        return study.best_trials[:top]
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    reverse = study.direction == optuna.study.StudyDirection.MAXIMIZE
    return sorted(complete, key=lambda t: t.value, reverse=reverse)[:top]


def export(study: optuna.Study, fmt: str = "json") -> str:
    rows = [_trial_row(t, full=True) for t in study.get_trials(deepcopy=False)]
    if fmt == "json":
        return json.dumps(rows, indent=2, default=str)
    if fmt == "csv":
        params = sorted({k for r in rows for k in r["params"]})
        attrs = sorted({k for r in rows for k in r["user_attrs"]})
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["number", "state", "values", "datetime_start", "datetime_complete",
                         *[f"params_{p}" for p in params], *[f"user_attrs_{a}" for a in attrs]])
        for r in rows:
            writer.writerow([r["number"], r["state"], json.dumps(r["values"]), r["datetime_start"],
                             r["datetime_complete"], *[r["params"].get(p, "") for p in params],
                             *[_cell(r["user_attrs"].get(a, "")) for a in attrs]])
        return out.getvalue()
    raise ValueError(f"unknown export format {fmt!r}; use json or csv")


def _cell(value: Any) -> str:
    return json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _trial_row(trial: FrozenTrial, full: bool = False) -> dict[str, Any]:
    row: dict[str, Any] = {"number": trial.number, "state": trial.state.name, "values": trial.values,
                           "params": trial.params}
    if trial.user_attrs.get(ATTR_RETRY_OF) is not None:
        row["retry_of"] = trial.user_attrs[ATTR_RETRY_OF]
    if full:
        row.update(user_attrs=trial.user_attrs, intermediate_values=trial.intermediate_values,
                   datetime_start=trial.datetime_start, datetime_complete=trial.datetime_complete)
    return row


def add_commands(sub: Any) -> None:
    """Register ``hpo`` and its subcommands on an argparse subparsers object."""
    hpo = sub.add_parser("hpo", help="inspect and repair a study: status, requeue, best, export")
    verbs = hpo.add_subparsers(dest="hpo_command", required=True)
    for name, help_text in (("status", "counts by state and failure kind, running trials, best trial"),
                            ("requeue", "fail stale trials as preempted and retry transient failures once"),
                            ("best", "the best trials"), ("export", "the whole history as JSON or CSV")):
        verb = verbs.add_parser(name, help=help_text)
        verb.add_argument("--storage", required=True, help="database URL or journal:///path/study.log")
        verb.add_argument("--study", required=True, help="study name")
        verb.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "requeue":
            verb.add_argument("--grace-period", type=float, default=DEFAULT_GRACE_PERIOD,
                              help="seconds without a heartbeat before a running trial counts as dead")
        if name == "best":
            verb.add_argument("--top", type=int, default=1)
        if name == "export":
            verb.add_argument("--format", choices=["json", "csv"], default="json")
            verb.add_argument("--output", help="file to write (default: standard output)")
    commands.add_commands(verbs)


def reseeded(storage: str, study: optuna.Study, top: int | None = None) -> list[dict[str, Any]] | None:
    """The ``top`` (default: all) configurations ranked by their mean over seeds, or None while none has a
    finished re-run."""
    from shardadopt.hpo.reseed import configurations, load_companion

    if len(study.directions) > 1:
        return None
    ranked = configurations(study, load_companion(resolve_storage(storage, heartbeat_interval=None),
                                                  study.study_name))
    return [c.as_dict() for c in ranked[:top]] if any(c.reruns for c in ranked) else None


def _config_line(row: dict[str, Any]) -> str:
    return (f"#{row['trial']}: mean {row['mean']:.6g} ± {row['std']:.2g} over {row['n_seeds']} seed(s) "
            f"{row['params']}")


def run(args: Any) -> int:
    if args.hpo_command in commands.VERBS:
        return commands.run(args)
    study = load_study(args.storage, args.study)
    if args.hpo_command == "status":
        report = status(study, now=time.time())
        if (ranked := reseeded(args.storage, study)) is not None:
            report["best_configuration"] = ranked[0]
            report["reseeded_configurations"] = [row for row in ranked if row["reruns"]]
        if args.json:
            print(json.dumps(report, indent=2, default=str))
            return 0
        print(f"study {report['study']}: {report['trials']} trials "
              + ", ".join(f"{state.lower()} {n}" for state, n in sorted(report["states"].items())))
        if report["failure_kinds"]:
            print("failures: " + ", ".join(f"{k} {n}" for k, n in sorted(report["failure_kinds"].items())))
        for r in report["running"]:
            print(f"  running #{r['number']} on {r['host']} pid {r['pid']}, heartbeat {r['heartbeat_age_s']} s ago")
        for r in report["best"]:
            print(f"best #{r['number']}: {r['values']} {r['params']}")
        for row in report.get("reseeded_configurations", []):
            print("re-run " + _config_line(row))
        if "best_configuration" in report:
            print("best configuration over seeds " + _config_line(report["best_configuration"]))
        return 0
    if args.hpo_command == "requeue":
        result = requeue(study, grace_period=args.grace_period)
        if args.json:
            print(json.dumps(result.as_dict(), indent=2))
        else:
            print(f"stale -> preempted: {result.failed_stale or 'none'}; retried: "
                  + (", ".join(f"#{old} as #{new}" for old, new in result.retried.items()) or "none"))
        return 0
    if args.hpo_command == "best":
        if (ranked := reseeded(args.storage, study, args.top)) is not None:
            print(json.dumps(ranked, indent=2, default=str) if args.json else "\n".join(map(_config_line, ranked)))
            return 0
        rows = [_trial_row(t) for t in best(study, args.top)]
        print(json.dumps(rows, indent=2, default=str) if args.json else
              "\n".join(f"#{r['number']} {r['values']} {r['params']}" for r in rows) or "no completed trials")
        return 0
    text = export(study, args.format)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text)
    else:
        print(text, end="" if text.endswith("\n") else "\n")
    return 0
