"""Loss-trajectory parity: Trainer on each load-time-sharded layout vs a single-process control, step by step.

    python benchmarks/loss_parity.py [--steps 50] [--layouts fsdp,tp,ep,hsdp,2d] [--out loss_parity]

Each layout trains the tiny checkpoint with Trainer (fp32, AdamW lr 1e-3, clipping at 1.0, sequential sampling)
on 2 or 4 gloo ranks; the control trains the same model in one process on the same global batches. Prints a table
of the per-layout max |relative difference| of the loss and grad_norm over all steps (target <= 1e-4 for the loss)
and writes ``<out>.md`` plus ``<out>.png`` (loss curves and relative differences; needs the ``shardadopt[plot]``
extra, matplotlib, and is skipped with a message naming it otherwise).
Layouts the installed transformers cannot load (HSDP and 2-D before 5.21) are reported as such.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

TARGET = 1e-4


def _max_rel(run: list[dict[str, float]], control: list[dict[str, float]], key: str) -> float:
    return max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(run, control))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layouts", default="fsdp,tp,ep,hsdp,2d")
    parser.add_argument("--out", default="loss_parity", help="path prefix of the .md table and .png plot")
    parser.add_argument("--models", default=None, help="tiny checkpoint directory (default: a temporary one)")
    args = parser.parse_args(argv)

    os.environ.update(TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1")
    import transformers

    from shardadopt.selftest.trainer import LAYOUTS, train_log
    from shardadopt.testing import RankPool, tiny_checkpoints
    from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes

    layouts = [name for name in args.layouts.split(",") if name]
    models = tiny_checkpoints(args.models or tempfile.mkdtemp(prefix="shardadopt-tiny-"))
    curves: dict[str, tuple[list, list]] = {}
    rows = []
    pools: dict[int, RankPool] = {}
    try:
        for name in layouts:
            layout = LAYOUTS[name]
            try:
                sizes, _ = distributed_sizes(name, layout.nproc)
            except LayoutUnsupported as exc:
                rows.append((name, layout.nproc, "-", None, None, f"not loadable: {exc}"))
                continue
            start = time.monotonic()
            control = train_log(models, name, args.steps, single_process=True)
            if layout.nproc not in pools:
                pools[layout.nproc] = RankPool(layout.nproc, env={"TRANSFORMERS_VERBOSITY": "error"})
            run = pools[layout.nproc].run(train_log, models, name, args.steps, timeout=1800)[0]
            loss, norm = _max_rel(run, control, "loss"), _max_rel(run, control, "grad_norm")
            verdict = "ok" if loss <= TARGET else f"FAIL (> {TARGET:g})"
            rows.append((name, layout.nproc, ",".join(f"{k}={v}" for k, v in sizes.items()), loss, norm,
                         f"{verdict}, {time.monotonic() - start:.0f}s"))
            curves[name] = (control, run)
            print(f"{name}: max |rel diff| loss {loss:.2e}, grad_norm {norm:.2e}", flush=True)
    finally:
        for pool in pools.values():
            pool.close()

    table = [f"Loss parity over {args.steps} steps, transformers {transformers.__version__} (fp32, gloo, CPU)", "",
             "| layout | ranks | DistributedConfig | max rel diff loss | max rel diff grad_norm | result |",
             "|---|---|---|---|---|---|"]
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2e}"

    for name, nproc, sizes, loss, norm, verdict in rows:
        table.append(f"| {name} | {nproc} | {sizes} | {fmt(loss)} | {fmt(norm)} | {verdict} |")
    text = "\n".join(table)
    print(text)
    with open(f"{args.out}.md", "w") as handle:
        handle.write(text + "\n")
    _plot(curves, f"{args.out}.png", args.steps)
    return 0 if all(loss is None or loss <= TARGET for _, _, _, loss, _, _ in rows) else 1


def _plot(curves: dict[str, tuple[list, list]], path: str, steps: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from shardadopt.hpo.plot import MISSING

        print(f"{MISSING}; no plot written", file=sys.stderr)
        return
    if not curves:
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, (control, run) in curves.items():
        x = range(1, len(run) + 1)
        line, = top.plot(x, [r["loss"] for r in run], label=f"{name} sharded")
        top.plot(x, [r["loss"] for r in control], "--", color=line.get_color(), label=f"{name} single process")
        bottom.semilogy(x, [max(abs(a["loss"] - b["loss"]) / abs(b["loss"]), 1e-12) for a, b in zip(run, control)],
                        label=name)
    top.set_ylabel("loss")
    top.legend(fontsize=8)
    bottom.axhline(TARGET, color="red", linestyle=":", label=f"target {TARGET:g}")
    bottom.set_ylabel("|rel diff| vs control (1e-12 floor)")
    bottom.set_xlabel(f"optimizer step (of {steps})")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
