"""Check every causal-LM (or image-text-to-text) architecture of the installed transformers on every layout, and
record the verdicts.

For each layout (``fsdp``, ``tp``, ``ep``: 2 ranks; ``hsdp``, ``2d``: 4 ranks, where the release loads them) and
each model type it applies to (every causal LM for FSDP/HSDP; those with a tensor-/expert-parallel plan for
TP/2-D/EP), a tiny random model derived from the type's default config runs the ordinary accelerate loop after
``shardadopt.enable()`` against one process (``shardadopt/testing/sweep.py`` states the check,
``sweep_compare.py`` its tolerances). All types of one layout share one process group. The verdicts go to
``shardadopt/data/arch_matrix/transformers-<minor>.json`` (one file per release line, cells merged, written after each
type so a long run keeps its progress; runs of different layouts at once merge their cells into the file under a
lock); ``tests/project/test_arch_sweep.py`` checks ``docs/architectures.md`` against them and re-runs a fixed sample
in CI. ``--task image-text-to-text`` does the same for the image-text-to-text mapping, each model trained on samples
of a real image and text (``shardadopt/testing/vlm.py``), recorded in ``image-text-to-text-transformers-<minor>.json``.

    python tools/arch_sweep.py                           # every layout and type, with this interpreter's releases
    python tools/arch_sweep.py --layouts tp --types apertus llama4_text     # refresh some cells
    python tools/arch_sweep.py --task image-text-to-text --layouts fsdp tp  # the vision-language models
    python tools/arch_sweep.py --docs                    # rewrite docs/architectures.md's coverage table from the data

Run it with each CI set's interpreter (``/path/to/venv/bin/python tools/arch_sweep.py``), from the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "shardadopt" / "data" / "arch_matrix"
COVERAGE_PAGE = REPO / "docs" / "architectures.md"
BEGIN, END = "<!-- arch-sweep:begin -->", "<!-- arch-sweep:end -->"
CAUSAL_LM, IMAGE_TEXT = "causal-lm", "image-text-to-text"  # shardadopt.testing.archs.TASKS
# task -> its coverage block's markers in docs/architectures.md
MARKERS = {CAUSAL_LM: (BEGIN, END),
           IMAGE_TEXT: ("<!-- arch-sweep:image-text-to-text:begin -->", "<!-- arch-sweep:image-text-to-text:end -->")}
LAYOUT_ORDER = ("fsdp", "tp", "ep", "hsdp", "2d")
# What was found out about a cell that is not verified, beyond what the check says: (type, layout, verdict) -> why.
# Attached to the recorded cell as "note" while its verdict is still that one (a changed verdict drops a stale note).
EXPLANATIONS: dict[tuple[str, str, str], str] = {
    ("llama4_text", "tp", "fails"):
        "loud, not silent: upstream's Llama4TextMoe.forward adds the routed experts' output in place "
        "(`out.add_(...)`) to the shared expert's output, which under TP is a view of a DTensor's local tensor "
        "(rowwise `to_local`), and autograd forbids modifying it in place; the fix is an out-of-place add upstream",
    ("gemma4_unified_text", "tp", "fails"):
        "marginal, a limit of the check: transformers 5.15 and 5.25 (verified on 5.24 at 0.90 of the allowance); every "
        "first-step gradient (0.09 of its tolerance), loss and norm matches, and after 3 Adam steps two parameters "
        "are 1.13x the allowance (10x what reordering one process's sums moves them): Adam's step normalisation "
        "amplifies fp32 noise in near-zero gradient elements; a missing or doubled reduction shows in the "
        "gradients, 10^3 times and more",
    ("llama4", "tp", "fails"):
        "loud, not silent: the text model of llama4_text (see there), loaded through the composite config",
    ("doge", "tp", "fails"):
        "loud, not silent: upstream's Doge plan makes `self_attn.dt_proj` rowwise, so its output (and the dynamic "
        "mask built from it with the replicated `A`) covers every key/value head while each rank's attention has "
        "half of them: a shape mismatch in the first forward",
    **{("deepseek_v4", layout, "fails"):
       "marginal, a limit of the check: every first-step gradient (0.03 of its tolerance), loss and norm matches; "
       "after 3 Adam steps one 3-element hyper-connection scale (`attn_hc.scale`) is 1.09x the allowance (10x what "
       "reordering one process's sums moves it): Adam normalises each step, so fp32 noise in near-zero gradient "
       "elements becomes a sizeable fraction of a step. Recorded before transformers-tp-partial-grad kept a "
       "parameter with an all-zero first gradient undecided, the same cell was 7.6x (`attn_hc.base`), with the "
       "per-step norm at 0.95 of its tolerance (now 0.05)"
       for layout in ("tp", "ep")},
    **{(t, "fsdp", "fails"):
       "explained, not silently wrong: the sinusoidal position table (`embed_positions`, an `nn.Embedding` built "
       "with `_freeze=True`: requires_grad False) stays frozen under FSDP and is trained by the one-process "
       "reference: transformers' one-process load replaces each loaded parameter with "
       "`nn.Parameter(value, requires_grad=value.is_floating_point())` (set_param_for_module), dropping the "
       "model's freeze, while the DTensor path keeps `ref.requires_grad`; the sharded run trains as the model "
       "defines it, the other differences follow from that table (an upstream bug of the one-process load)"
       for t in ("pegasus", "roformer")},
    ("moshi", "fsdp", "fails"):
        "explained, batch-coupled loss upstream, not a sharding error: transformers 5.15's MoshiForCausalLM shifts "
        "and flattens logits and labels itself, then passes them to loss_function (ForCausalLMLoss), which shifts "
        "again over the flattened batch: each row's last position predicts the next row's second token and only "
        "the batch's last token is ignored, so the loss changes with how a batch is split (one process on each "
        "micro-batch in two halves gives exactly the FSDP run's losses and gradients, 6020x the tolerance from the "
        "whole batch); fixed in 5.24, verified there",
    ("paligemma", "tp", "refused by shardadopt"):
        "image-text-to-text: PaliGemma's language model is multi-query (Gemma 2B: one key/value head, which the tiny "
        "config keeps); transformers' TP plan shards `k_proj`/`v_proj` colwise without checking that tp_size divides "
        "num_key_value_heads, so each rank would hold half a head (before transformers-tp-heads-refused: a `view` "
        "error at the first forward); any tp_size > 1 is refused so on the real checkpoints. fsdp verified",
    ("hunyuan_vl", "fsdp", "fails"):
        "image-text-to-text: batch-dependent in one process, not a sharding error: one process with each "
        "micro-batch in two halves (the split FSDP makes across its 2 ranks) moves the first-step gradients as far "
        "from the whole-batch reference (1431x the tolerance) as the FSDP run does (1430x); loss within 0.5 of its "
        "tolerance; tp (no split of the batch) verified. Which part of HunYuan-VL couples the rows of a batch is "
        "not found yet",
    ("qwen3_5_moe", "tp", "fails"):
        "image-text-to-text: marginal, a limit of the check: every first-step gradient (0.018 of its tolerance), "
        "loss and norm matches; after 3 Adam steps three parameters of one gated-delta-net layer (`linear_attn."
        "A_log`, `dt_bias`, `in_proj_a`, gradients ~1e-4) are 3.7x the RMS allowance (max difference 7e-6, 1.5% of "
        "the max allowance). Sharding the matmuls changes fp32 sums that reordering one process's batch does not "
        "(that moves `A_log` by 2.4e-7), and transformers' reference gated-delta kernel computes in fp32 whatever "
        "the model's dtype: the whole check in float64 still leaves `A_log` at 1.1x (measured 2026-12-07)",
    ("qwen3_5", "2d", "fails"):
        "image-text-to-text: marginal, the pattern of qwen3_5_moe tp (see there; not measured in float64 here): every "
        "first-step gradient (0.012 of its tolerance), loss and norm matches, fsdp, tp and hsdp are verified, and "
        "after 3 Adam steps one gated-delta-net parameter (`linear_attn.dt_bias`, computed by the fp32-only reference "
        "kernel) is 4.5x the allowance",
    ("llama4_text", "ep", "fails"):
        "loud, not silent: transformers 5.15's Llama4 EP plan puts `ep_router` on `feed_forward.router`, whose "
        "output hook unpacks (logits, scores, indices) while Llama4Router returns (scores, logits): the first forward "
        "raises; 5.24 has no EP plan for llama4_text",
}


def annotate(matrix: dict) -> None:
    """Attach each cell's explanation (``EXPLANATIONS``) while its verdict is the explained one."""
    for model_type, cells in matrix["cells"].items():
        for layout, cell in cells.items():
            cell.pop("note", None)
            note = EXPLANATIONS.get((model_type, layout, cell["verdict"]))
            if note:
                cell["note"] = note


def _prefix(task: str) -> str:
    return "" if task == CAUSAL_LM else f"{task}-"


def release_file(transformers_version: str, task: str = CAUSAL_LM) -> Path:
    return DATA / f"{_prefix(task)}transformers-{'.'.join(transformers_version.split('.')[:2])}.json"


def load_matrices(task: str = CAUSAL_LM) -> list[dict]:
    """Every recorded release line of ``task``, oldest first."""
    from packaging.version import Version

    matrices = [json.loads(p.read_text()) for p in DATA.glob(f"{_prefix(task)}transformers-*.json")]
    return sorted(matrices, key=lambda m: Version(m["transformers"]))


def _versions() -> dict[str, str]:
    import accelerate
    import torch
    import transformers

    return {"transformers": transformers.__version__, "accelerate": accelerate.__version__,
            "torch": torch.__version__.split("+")[0]}


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on ``path``'s lock file, in the temporary directory (runs of other layouts write
    the same matrix)."""
    with open(Path(tempfile.gettempdir()) / f"shardadopt-{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _settled(cell: dict | None) -> bool:
    """Whether ``--resume`` keeps a recorded cell: any verdict but "not testable here", which is about the harness
    of its day (glm4v_moe's image processor, found once the harness used an MoE type's dense sibling's: a resumed
    run kept the old cells) rather than the model."""
    from shardadopt.testing.sweep_compare import NOT_TESTABLE

    return cell is not None and cell["verdict"] != NOT_TESTABLE


def run(layouts: list[str], only_types: list[str] | None, root: Path, timeout: float, resume: bool,
        task: str = CAUSAL_LM) -> int:
    sys.path.insert(0, str(REPO))
    from shardadopt.testing import sweep, sweep_compare, sweep_run

    versions = _versions()
    path = release_file(versions["transformers"], task)
    DATA.mkdir(parents=True, exist_ok=True)
    recorded: dict[tuple[str, str], dict] = {}  # the cells this run found, merged into the file at each write

    def read() -> dict:
        matrix = json.loads(path.read_text()) if path.exists() else {}
        if matrix and matrix["transformers"] != versions["transformers"]:
            matrix["cells"] = {}  # another patch release of the line: start over rather than mix releases
        matrix.update({"generated_by": "tools/arch_sweep.py", **versions,
                       "tolerances": {"grad_rtol": sweep_compare.GRAD_RTOL, "grad_floor": sweep_compare.GRAD_FLOOR,
                                      "step_rtol": sweep_compare.STEP_RTOL,
                                      "noise_factor": sweep_compare.NOISE_FACTOR,
                                      "steps": sweep_run.STEPS, "accumulation": sweep_run.ACCUM}})
        if task != CAUSAL_LM:
            matrix["task"] = task
        matrix.setdefault("cells", {})
        matrix.setdefault("runs", [])
        return matrix

    candidates = {layout: len(sweep.candidates(layout, task)) for layout in LAYOUT_ORDER}
    log = root / f"ranks-{task}-{versions['transformers']}-{'-'.join(layouts)}.log"
    root.mkdir(parents=True, exist_ok=True)
    print(f"transformers {versions['transformers']}, {task}; rank output in {log}", flush=True)

    def write(new_run: dict | None = None) -> None:
        with _locked(path):
            matrix = read()
            matrix["candidates"] = candidates
            for (model_type, layout), cell in recorded.items():
                matrix["cells"].setdefault(model_type, {})[layout] = cell
            if new_run is not None:
                matrix["runs"].append(new_run)
            annotate(matrix)
            matrix["cells"] = {t: dict(sorted(c.items(), key=lambda kv: LAYOUT_ORDER.index(kv[0])))
                               for t, c in sorted(matrix["cells"].items())}
            path.write_text(json.dumps(matrix, indent=1) + "\n")

    for layout in layouts:
        done = read()["cells"]
        types = [t for t in sweep.candidates(layout, task) if (not only_types or t in only_types)
                 and not (resume and _settled(done.get(t, {}).get(layout)))]
        started, load = time.monotonic(), os.getloadavg()[0]
        print(f"=== {layout}: {len(types)} types", flush=True)

        def record(model_type: str, cell, layout=layout) -> None:
            recorded[model_type, layout] = cell.as_dict()
            print(f"  {model_type:<28} {cell.verdict:<22} {cell.seconds:>6.1f}s {cell.detail[:150]}", flush=True)
            write()

        sweep.sweep_layout(types, layout, root / task / versions["transformers"], record, timeout=timeout,
                           log=str(log), task=task)
        # each invocation's wall time and the machine's 1-minute load average before and after it
        write({"layout": layout, "types": len(types), "seconds": round(time.monotonic() - started),
               "load_average": [round(load, 1), round(os.getloadavg()[0], 1)],
               "cpus": os.cpu_count(), "date": datetime.date.today().isoformat()})
    print(f"wrote {path.relative_to(REPO)}")
    return 0


def _line(transformers_version: str) -> str:
    return ".".join(transformers_version.split(".")[:2])


def coverage_section(matrices: list[dict]) -> str:
    """The coverage table and notes of ``docs/architectures.md``, derived from the recorded matrices."""
    from shardadopt.testing.sweep_compare import VERDICTS

    lines = ["| transformers | layout | types | " + " | ".join(VERDICTS) + " | run time |",
             "|---|---|---|" + "---|" * len(VERDICTS) + "---|"]
    notable: list[str] = []
    untestable: list[str] = []
    for matrix in matrices:
        line = _line(matrix["transformers"])
        for layout in LAYOUT_ORDER:
            cells = {t: c[layout] for t, c in matrix["cells"].items() if layout in c}
            if not cells:
                continue
            counts = Counter(c["verdict"] for c in cells.values())
            minutes = sum(c.get("seconds", 0.0) for c in cells.values()) / 60
            total = matrix["candidates"].get(layout, len(cells))
            swept = str(total) if len(cells) == total else f"{len(cells)} of {total} (partial run)"
            lines.append(f"| {line} | {layout} | {swept} | " + " | ".join(str(counts[v]) for v in VERDICTS)
                         + f" | {minutes:.0f} min |")
            for model_type, cell in sorted(cells.items()):
                if cell["verdict"] in (VERDICTS[0], VERDICTS[-1]):
                    if cell["verdict"] == VERDICTS[-1]:
                        untestable.append(f"{model_type} ({line} {layout})")
                    continue
                notable.append(f"- `{model_type}` {layout}, transformers {line}: **{cell['verdict']}**: "
                               f"{_short(cell['detail'])}" + (f" *{cell['note']}*" if cell.get("note") else ""))
    out = lines + [""]
    out += ["Not verified (each a fix to make or a limitation stated here):", ""] + (notable or ["- none"])
    out += ["", f"Not testable here ({len(untestable)} cells; reasons in the data files): "
            + ", ".join(untestable) + "."]
    return "\n".join(out)


def _short(text: str, limit: int = 220) -> str:
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def coverage_block(text: str, task: str = CAUSAL_LM) -> str | None:
    begin, end = MARKERS[task]
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def write_coverage_page() -> None:
    sys.path.insert(0, str(REPO))
    text = COVERAGE_PAGE.read_text()
    for task, (begin, end) in MARKERS.items():
        if coverage_block(text, task) is None:
            raise SystemExit(f"docs/architectures.md has no {begin} ... {end} block to rewrite")
        for path in DATA.glob(f"{_prefix(task)}transformers-*.json"):  # explanations added since recorded
            matrix = json.loads(path.read_text())
            annotate(matrix)
            path.write_text(json.dumps(matrix, indent=1) + "\n")
        before, rest = text.split(begin, 1)
        after = rest.split(end, 1)[1]
        text = f"{before}{begin}\n{coverage_section(load_matrices(task))}\n{end}{after}"
    COVERAGE_PAGE.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", action="store_true", help="only rewrite the coverage table of docs/architectures.md")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUT_ORDER, default=list(LAYOUT_ORDER))
    parser.add_argument("--types", nargs="+", help="only these model types (default: every one)")
    parser.add_argument("--task", choices=sorted(MARKERS), default=CAUSAL_LM,
                        help="which Auto mapping's types, and what they train on (default: causal-lm)")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "shardadopt-arch-sweep",
                        help="tiny checkpoints, one-process references and the ranks' log (default: in the "
                             "temporary directory)")
    parser.add_argument("--resume", action="store_true",
                        help="skip the cells this release already has (but retry those not testable here)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per type before its ranks count as hung")
    args = parser.parse_args(argv)
    if args.docs:
        write_coverage_page()
        return 0
    return run(args.layouts, args.types, args.root, args.timeout, args.resume, args.task)


if __name__ == "__main__":
    sys.exit(main())
