"""``shardadopt hpo warm-start|reseed|check-pruning|plot``: what to do before trusting a search for a release."""

from __future__ import annotations

import json
from typing import Any

from shardadopt.hpo.storage import resolve_storage

VERBS = ("warm-start", "reseed", "check-pruning", "plot")


def add_commands(verbs: Any) -> None:
    """Register the verbs on ``shardadopt hpo``'s subparsers."""
    warm = verbs.add_parser("warm-start", help="enqueue the best trials of an old space version's study into the "
                                               "new version's study, mapped onto the new space")
    warm.add_argument("--from", dest="source", required=True, help="the old study")
    warm.add_argument("--to", dest="target", required=True, help="the new study (created when missing)")
    warm.add_argument("--top", type=int, default=5, help="how many of the best configurations (default 5)")
    warm.add_argument("--space", help="the new space's hp_space as module:function (default: the distributions "
                                      "the new study's trials used)")
    warm.add_argument("--out-of-range", choices=["clip", "skip"], default="clip",
                      help="a value outside a new range: clip it (default) or skip the trial")
    reseed = verbs.add_parser("reseed", help="enqueue the best configurations again with fresh seeds, into the "
                                             "companion study <study>-reseed")
    reseed.add_argument("--top", type=int, default=5)
    reseed.add_argument("--seeds", type=int, default=3, help="re-runs per configuration (default 3)")
    check = verbs.add_parser("check-pruning", help="do values at the first rung rank trials like their final values?")
    check.add_argument("--rung", type=int, help="the step to compare at (default: the first step all reported)")
    plot = verbs.add_parser("plot", help="PNGs: history, intermediate values, importances, seed spread")
    plot.add_argument("--out", required=True, help="directory for the PNGs")
    for verb in (warm, reseed, check, plot):
        verb.add_argument("--storage", required=True, help="database URL or journal:///path/study.log")
        if verb is not warm:
            verb.add_argument("--study", required=True, help="study name")
        verb.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: Any) -> int:
    storage = resolve_storage(args.storage, heartbeat_interval=None)
    if args.hpo_command == "warm-start":
        from shardadopt.hpo.warmstart import import_space, space_distributions, warm_start

        space = space_distributions(import_space(args.space)) if args.space else None
        result = warm_start(storage, args.source, args.target, args.top, space=space,
                            out_of_range=args.out_of_range)
        if args.json:
            return _print_json(result.as_dict())
        for number, params in result.enqueued.items():
            print(f"#{number} of {result.source} enqueued into {result.target}: {params}"
                  + "".join(f"; {note}" for note in result.notes.get(number, [])))
        for number, why in result.skipped.items():
            print(f"#{number} of {result.source} skipped: {why}")
        if result.present:
            print(f"already warm-started into {result.target}: " + ", ".join(f"#{n}" for n in result.present))
        return 0
    from shardadopt.hpo.report import load_study

    study = load_study(args.storage, args.study)
    if args.hpo_command == "reseed":
        from shardadopt.hpo.reseed import reseed

        result = reseed(storage, args.study, args.top, args.seeds)
        if args.json:
            return _print_json(result.as_dict())
        for number, seeds in result.enqueued.items():
            print(f"#{number}: enqueued seeds {seeds} into {result.companion}")
        for number, seeds in result.present.items():
            print(f"#{number}: seeds {seeds} already in {result.companion}")
        print(f"run them: attach your jobs to study {result.companion!r} (same script and hp_space)")
        return 0
    if args.hpo_command == "check-pruning":
        from shardadopt.hpo.pruning_check import check_pruning

        result = check_pruning(study, args.rung)
        if args.json:
            return _print_json(result.as_dict())
        print(f"study {result.study}, rung {result.rung}: {len(result.trials)} trials compared, Spearman "
              f"{result.spearman:.2f}, Kendall {result.kendall:.2f}, final best #{result.final_best} in the top "
              f"third {result.top_third}: {'yes' if result.best_in_top_third else 'no'}")
        print(f"verdict: {result.verdict.upper()}: {result.reason}")
        return 0
    from shardadopt.hpo.plot import write_plots
    from shardadopt.hpo.reseed import load_companion

    result = write_plots(study, args.out, load_companion(storage, args.study))
    if args.json:
        return _print_json(result.as_dict())
    for name, path in result.written.items():
        print(f"{name}: {path}")
    for name, why in result.skipped.items():
        print(f"{name}: not drawn ({why})")
    return 0


def _print_json(payload: dict[str, Any]) -> int:
    print(json.dumps(payload, indent=2, default=str))
    return 0
