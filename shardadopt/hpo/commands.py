"""``shardadopt hpo warm-start|reseed|check-pruning|plot``: what to do before trusting a search for a release."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from shardadopt.hpo.storage import load_study, resolve_storage

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
    """One verb: its result as JSON (``--json``) or as the lines ``show`` prints."""
    storage = resolve_storage(args.storage, heartbeat_interval=None)
    compute, show = _VERB_STEPS[args.hpo_command]
    result = compute(args, storage)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2, default=str))
    else:
        show(result)
    return 0


def _study(args: Any) -> Any:
    return load_study(args.storage, args.study)  # a missing study raises its clear error before any work


def _warm_start(args: Any, storage: Any) -> Any:
    from shardadopt.hpo.warmstart import import_space, space_distributions, warm_start

    space = space_distributions(import_space(args.space)) if args.space else None
    return warm_start(storage, args.source, args.target, args.top, space=space, out_of_range=args.out_of_range)


def _show_warm_start(result: Any) -> None:
    for number, params in result.enqueued.items():
        print(f"#{number} of {result.source} enqueued into {result.target}: {params}"
              + "".join(f"; {note}" for note in result.notes.get(number, [])))
    for number, why in result.skipped.items():
        print(f"#{number} of {result.source} skipped: {why}")
    if result.present:
        print(f"already warm-started into {result.target}: " + ", ".join(f"#{n}" for n in result.present))


def _reseed(args: Any, storage: Any) -> Any:
    from shardadopt.hpo.reseed import reseed

    _study(args)
    return reseed(storage, args.study, args.top, args.seeds)


def _show_reseed(result: Any) -> None:
    for number, seeds in result.enqueued.items():
        print(f"#{number}: enqueued seeds {seeds} into {result.companion}")
    for number, seeds in result.present.items():
        print(f"#{number}: seeds {seeds} already in {result.companion}")
    print(f"run them: attach your jobs to study {result.companion!r} (same script and hp_space)")


def _check_pruning(args: Any, storage: Any) -> Any:
    from shardadopt.hpo.pruning_check import check_pruning

    return check_pruning(_study(args), args.rung)


def _show_check_pruning(result: Any) -> None:
    print(f"study {result.study}, rung {result.rung}: {len(result.trials)} trials compared, Spearman "
          f"{result.spearman:.2f}, Kendall {result.kendall:.2f}, final best #{result.final_best} in the top "
          f"third {result.top_third}: {'yes' if result.best_in_top_third else 'no'}")
    print(f"verdict: {result.verdict.upper()}: {result.reason}")


def _plot(args: Any, storage: Any) -> Any:
    from shardadopt.hpo.plot import write_plots
    from shardadopt.hpo.reseed import load_companion

    return write_plots(_study(args), args.out, load_companion(storage, args.study))


def _show_plot(result: Any) -> None:
    for name, path in result.written.items():
        print(f"{name}: {path}")
    for name, why in result.skipped.items():
        print(f"{name}: not drawn ({why})")


# verb -> (what it computes from the arguments and the storage, how its result is printed without --json)
_VERB_STEPS: dict[str, tuple[Callable[[Any, Any], Any], Callable[[Any], None]]] = {
    "warm-start": (_warm_start, _show_warm_start),
    "reseed": (_reseed, _show_reseed),
    "check-pruning": (_check_pruning, _show_check_pruning),
    "plot": (_plot, _show_plot),
}
