"""The architecture sweep's check: the ordinary accelerate loop on a tiny model of one type, sharded at load time
with one layout, against one process on the same global batches. Two tasks: causal LMs train on token rows;
image-text-to-text models on samples of one real image and text each (``shardadopt/testing/vlm.py`` builds them).

Used by ``tools/arch_sweep.py`` (every type, every layout, recorded per transformers release), its CI sample
(``tests/project/test_arch_sweep.py``) and ``shardadopt doctor --model ... --check``. All types of one layout run in one
process group (:class:`~shardadopt.testing.pool.RankPool`); a type whose ranks raise apart or hang costs that
pool (restarted for the next type), never the sweep.

Verdicts: ``verified``; ``refused upstream`` (transformers' load raises: its message); ``refused by shardadopt``
(shardadopt refuses the layout at load time, loudly); ``fails`` (what differs, or what raises after loading);
``not testable here`` (why: no tiny config derives from the type's defaults, one process cannot train it here,
the layout needs more ranks than the type has heads, ...).

Tolerances (fp32 everywhere; the distributed run only reorders floating-point sums):

- first-step gradients: a parameter's gradient matches when ``max|g - g_ref| <= GRAD_RTOL * scale``, where
  ``scale`` is the parameter's largest reference gradient element, floored at ``GRAD_FLOOR`` times the model's
  largest one (a gradient that nearly cancels is judged against the model's gradient scale, not its own noise).
  fp32 sums over the ~10^3 terms of these tiny models reorder to ~1e-6 relative; 1e-4 leaves two orders of
  margin while a missing or doubled reduction over 2 ranks is off by 0.5 or more.
- per-step loss and clipped (total) grad norm: relative ``STEP_RTOL``; final parameters: the selftest's rule (no
  element off by half a step, RMS within 1e-3 of the learning rate). Adam normalises every update, so noise in a
  gradient element near zero moves that parameter by a sizeable fraction of a step, which later steps see: these
  three are also allowed ``NOISE_FACTOR`` times what the same one-process run with its micro-batches reordered
  moves them (measured per model where the fixed tolerance is exceeded, see :func:`reorder_noise`), whichever is
  larger.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from shardadopt.testing.archs import CAUSAL_LM, IMAGE_TEXT

VERIFIED = "verified"
REFUSED_UPSTREAM = "refused upstream"
REFUSED_SHARDADOPT = "refused by shardadopt"
FAILS = "fails"
NOT_TESTABLE = "not testable here"
VERDICTS = (VERIFIED, REFUSED_UPSTREAM, REFUSED_SHARDADOPT, FAILS, NOT_TESTABLE)

STEPS = 3
ACCUM = 2
PER_DP_BATCH = 2
SEQ_LEN = 16
LR = 1e-3
# Final parameters: the selftest's rule for this LR (shardadopt.selftest.accelerate says why).
PARAM_MAX_DIFF = 0.5 * LR
PARAM_RMS = 1e-3 * LR
MAX_NORM = 0.5
SEED = 1234
GRAD_RTOL = 1e-4
GRAD_FLOOR = 1e-2
STEP_RTOL = 1e-4
NOISE_FACTOR = 10

# layout -> (ranks, plan the type needs)
LAYOUTS: dict[str, tuple[int, str | None]] = {"fsdp": (2, None), "tp": (2, "tp"), "ep": (2, "ep"),
                                              "hsdp": (4, None), "2d": (4, "tp")}


@dataclass
class Cell:
    verdict: str
    detail: str = ""
    worst: dict[str, float] = field(default_factory=dict)  # measured error / tolerance, per quantity
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "detail": self.detail, "worst": self.worst, "seconds": self.seconds}


def layout_sizes(layout: str) -> tuple[dict[str, Any], int] | str:
    """(DistributedConfig kwargs, data-parallel size) for ``layout`` on the installed transformers, or why it
    cannot be loaded there."""
    from shardadopt.testing.layouts import LayoutUnsupported, distributed_sizes, unloadable_reason

    try:
        sizes, dp = distributed_sizes(layout, LAYOUTS[layout][0])
    except LayoutUnsupported as exc:
        return str(exc)
    return unloadable_reason(sizes) or (sizes, dp)


def candidates(layout: str, task: str = CAUSAL_LM) -> list[str]:
    """The model types the sweep checks on ``layout`` for ``task``: every type (FSDP, HSDP) or those with the
    plan the layout shards by."""
    from shardadopt.testing.archs import causal_lm_types

    return causal_lm_types(LAYOUTS[layout][1], task)


def _sample_count(dp: int) -> int:
    return STEPS * ACCUM * dp * PER_DP_BATCH


def _rows(dp: int):
    import torch

    return torch.randint(0, 512, (_sample_count(dp), SEQ_LEN), generator=torch.Generator().manual_seed(SEED))


def _samples(path: str, dp: int, task: str) -> list[dict[str, Any]]:
    """The run's samples in order: token rows (causal LM), or the image-text samples written next to the tiny
    checkpoint (:func:`shardadopt.testing.vlm.write_batches`)."""
    import torch

    if task == CAUSAL_LM:
        return [{"input_ids": row, "labels": row} for row in _rows(dp)]
    return torch.load(os.path.join(path, f"samples-{_sample_count(dp)}.pt"))


def _auto_class(task: str):
    import transformers

    return {CAUSAL_LM: transformers.AutoModelForCausalLM,
            IMAGE_TEXT: transformers.AutoModelForImageTextToText}[task]


class RandomForward(RuntimeError):
    """The model's training forward draws random numbers: one process and the sharded run cannot agree."""


def reference(path: str, dp: int, split: int = 1, task: str = CAUSAL_LM) -> dict[str, Any]:
    """One process: the same optimizer steps on the same global batches (``dp * PER_DP_BATCH`` rows a
    micro-step). ``split``: each micro-batch's backward runs on that many equal chunks, the same sum in another
    floating-point order (what a sharded run changes too), which measures how far fp32 noise alone moves later
    steps of this model. Raises :class:`RandomForward` when two forwards of one batch differ."""
    import torch

    from shardadopt.testing.vlm import collate

    model = _auto_class(task).from_pretrained(path, dtype=torch.float32)
    model.train()
    rows, micro_rows = _samples(path, dp, task), dp * PER_DP_BATCH
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        first = model(**collate(rows[:micro_rows])).loss
        torch.manual_seed(2)
        if not torch.equal(first, model(**collate(rows[:micro_rows])).loss):
            raise RandomForward("its training forward draws random numbers (two forwards of one batch differ), "
                                "so one process and the sharded run cannot agree")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, norms, grads = [], [], None
    for step in range(STEPS):
        micro = []
        for m in range(ACCUM):
            batch = rows[(step * ACCUM + m) * micro_rows:(step * ACCUM + m + 1) * micro_rows]
            chunk_losses = []
            for c in range(split):
                chunk = batch[c * len(batch) // split:(c + 1) * len(batch) // split]
                loss = model(**collate(chunk)).loss
                (loss / (ACCUM * split)).backward()
                chunk_losses.append(loss.detach())
            micro.append(torch.stack(chunk_losses).mean())
        if grads is None:
            grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(torch.stack(micro).mean()))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def reorder_noise(path: str, dp: int, expected: dict[str, Any], task: str = CAUSAL_LM) -> dict[str, Any] | None:
    """:func:`reference` with each micro-batch in two chunks when that is only a reordering (its first-step
    gradients within the gradient tolerance of ``expected``), else None (batch-dependent math, e.g.
    capacity-limited routing)."""
    reordered = reference(path, dp, split=2, task=task)
    return reordered if _grad_ratio([reordered["grads"]], expected["grads"])[0] <= 1 else None


def check_rank(path: str, sizes: dict[str, Any], dp: int, task: str = CAUSAL_LM) -> dict[str, Any]:
    """On every rank of a pool: the accelerate loop users write, after ``shardadopt.enable()``, on ``path`` loaded
    with ``DistributedConfig(**sizes)``. Returns this rank's losses, norms, first-step gradients and final
    parameters (DTensors whole, plain tensors as this rank holds them), or the stage that raised."""
    import torch
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.testing import full
    from shardadopt.testing.accelerator import fresh_accelerator
    from shardadopt.testing.vlm import collate

    shardadopt.enable()
    try:
        accelerator = fresh_accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
        try:
            model = _auto_class(task).from_pretrained(path, dtype=torch.float32,
                                                      distributed_config=DistributedConfig(**sizes))
        except Exception as exc:
            return {"stage": "load", "error": _error(exc), "shardadopt": _raised_by_shardadopt(exc)}
        try:
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
            loader = torch.utils.data.DataLoader(_samples(path, dp, task), batch_size=PER_DP_BATCH,
                                                 collate_fn=collate)
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            losses, norms, micro, grads = [], [], [], None
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    micro.append(loss.detach())
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        if grads is None:
                            grads = {n: None if p.grad is None else full(p.grad).detach().clone()
                                     for n, p in accelerator.unwrap_model(model).named_parameters()}
                        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                        losses.append(float(accelerator.reduce(torch.stack(micro).mean(), "mean")))
                        micro = []
                    optimizer.step()
                    optimizer.zero_grad()
            params = {n: full(p).detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
        except Exception as exc:
            return {"stage": "train", "error": _error(exc)}
        return {"losses": losses, "norms": norms, "grads": grads, "params": params}
    finally:
        shardadopt.disable()


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 400 else text[:397] + "..."


def _raised_by_shardadopt(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("shardadopt")


def _whole(pieces: list, shape) -> tuple[list, bool]:
    """The candidates for a parameter's full value from the ranks' copies, and whether each must match: every
    rank's whole copy (all must), or the ranks' shards put together along the one dim where they are smaller,
    plainly or as packed halves (``gate_up_proj``: each rank holds its gate rows then its up rows); one layout
    must match."""
    import torch

    if all(p.shape == shape for p in pieces):
        return pieces, True
    dims = [d for d, (a, b) in enumerate(zip(pieces[0].shape, shape)) if a != b]
    if len(dims) != 1:
        return [], False
    dim = dims[0]
    candidates = [torch.cat(pieces, dim=dim)]
    if pieces[0].shape[dim] % 2 == 0:
        halves = [p.chunk(2, dim=dim) for p in pieces]
        candidates.append(torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim))
    return [c for c in candidates if c.shape == shape], False


def _worst(candidates: list, every: bool, error: Callable[[Any], float]) -> float:
    if not candidates:
        return float("inf")
    errors = [error(c) for c in candidates]
    return max(errors) if every else min(errors)


def _grad_ratio(per_rank: list[dict[str, Any]], expected: dict[str, Any]) -> tuple[float, list[str]]:
    """The worst first-step gradient error over its tolerance, and the parameters beyond it."""
    scale = max((float(g.abs().max()) for g in expected.values() if g is not None), default=0.0)
    worst, bad = 0.0, []
    for name, want in expected.items():
        pieces = [r.get(name) for r in per_rank]
        if want is None or any(p is None for p in pieces):
            if want is not None or any(p is not None for p in pieces):
                bad.append(f"{name} (gradient missing on some side)")
                worst = float("inf")
            continue
        tolerance = GRAD_RTOL * max(float(want.abs().max()), GRAD_FLOOR * scale, 1e-30)
        error = _worst(*_whole(pieces, want.shape), lambda c, want=want: float((c - want).abs().max()))
        ratio = error / tolerance
        worst = max(worst, ratio)
        if ratio > 1:
            bad.append(f"{name} (max diff {error:.3g}, {ratio:.3g}x the tolerance)")
    return worst, bad


def compare(results: list[dict[str, Any]], expected: dict[str, Any], noise: dict[str, Any] | None = None) -> Cell:
    """The verdict of one type and layout from every rank's :func:`check_rank` result.

    Later steps (losses, norms, final parameters) are held to the fixed tolerances or, given ``noise`` (the
    reordered one-process run, :func:`reorder_noise`), to ``NOISE_FACTOR`` times how far it moved from the
    reference, whichever is larger:
    Adam turns reduction-order noise in a gradient at fp32 noise level (a ``k_proj.bias``, whose gradient is zero
    up to rounding because softmax ignores a shift) into updates of a sizeable fraction of a step.
    """
    import torch

    failed = next((r for r in results if "error" in r), None)
    if failed is not None:
        if failed["stage"] == "load":
            return Cell(REFUSED_SHARDADOPT if failed["shardadopt"] else REFUSED_UPSTREAM, failed["error"])
        return Cell(FAILS, f"raises in the accelerate loop: {failed['error']}")
    first, worst, problems = results[0], {}, []
    for what in ("losses", "norms"):
        got, want = torch.tensor(first[what]), torch.tensor(expected[what])
        if got.shape != want.shape:
            problems.append(f"{len(first[what])} {what}, one process {len(expected[what])}")
            continue
        allowed = STEP_RTOL * want.abs()
        if noise is not None:
            allowed = torch.maximum(allowed, NOISE_FACTOR * (torch.tensor(noise[what]) - want).abs())
        ratios = (got - want).abs() / allowed.clamp_min(1e-30)
        worst[what] = float(ratios.max())
        if worst[what] > 1:
            step = int(ratios.argmax())
            problems.append(f"{ {'losses': 'loss', 'norms': 'norm'}[what]} at step {step}: {got[step]:.7g} vs "
                            f"one process {want[step]:.7g}")
    worst["grads"], bad_grads = _grad_ratio([r["grads"] for r in results], expected["grads"])
    if bad_grads:
        problems.append(f"first-step gradients of {len(bad_grads)} parameters: {', '.join(bad_grads[:4])}")
    bad_params = []
    for name, want in expected["params"].items():
        max_allowed, rms_allowed = PARAM_MAX_DIFF, PARAM_RMS
        if noise is not None:
            moved = (noise["params"][name] - want).abs()
            max_allowed = max(max_allowed, NOISE_FACTOR * float(moved.max()))
            rms_allowed = max(rms_allowed, NOISE_FACTOR * float(moved.pow(2).mean().sqrt()))
        pieces = [r["params"].get(name) for r in results]
        if any(p is None for p in pieces):
            bad_params.append(f"{name} (missing on some rank)")
            continue

        def error(got, want=want, max_allowed=max_allowed, rms_allowed=rms_allowed) -> float:
            diff = (got - want).abs()
            return max(float(diff.max()) / max_allowed, float(diff.pow(2).mean().sqrt()) / rms_allowed)

        ratio = _worst(*_whole(pieces, want.shape), error)
        worst["params"] = max(worst.get("params", 0.0), ratio)
        if ratio > 1:
            bad_params.append(name)
    if bad_params:
        problems.append(f"final parameters of {len(bad_params)}: {', '.join(bad_params[:4])}")
    worst = {k: float(f"{v:.3g}") for k, v in worst.items()}
    return Cell(FAILS, "; ".join(problems), worst) if problems else Cell(VERIFIED, "", worst)


def _cached(file: str, compute: Callable[..., Any], *args: Any) -> Any:
    import torch

    if os.path.exists(file):
        return torch.load(file)
    with torch.random.fork_rng():
        value = compute(*args)
    torch.save(value, file)
    return value


def sweep_layout(types: Iterable[str], layout: str, root: str | os.PathLike,
                 on_cell: Callable[[str, Cell], None], timeout: float = 300.0, log: str | None = None,
                 config_values: dict[str, Any] | None = None, pool: Any = None, task: str = CAUSAL_LM) -> None:
    """Check every type of ``types`` on ``layout`` in one process group; ``on_cell(type, cell)`` after each.

    Tiny checkpoints of ``task``'s class (shrunk from ``config_values``, a checkpoint's config, or each type's
    default config), their image-text samples and one-process references are made in this process and cached
    under ``root``. ``pool``: a
    :class:`~shardadopt.testing.pool.RankPool` of the layout's size to run on (default: one started here, and
    started again after a type whose ranks raised apart or hung).
    """
    from shardadopt.testing.archs import write_tiny
    from shardadopt.testing.pool import RankError, RankPool, RankTimeout
    from shardadopt.testing.vlm import write_batches

    types = list(types)
    sizes = layout_sizes(layout)
    if isinstance(sizes, str):
        for model_type in types:
            on_cell(model_type, Cell(NOT_TESTABLE, f"{layout}: {sizes}"))
        return
    sizes, dp = sizes
    nproc = LAYOUTS[layout][0]
    owned = pool is None
    try:
        for model_type in types:
            started = time.monotonic()
            try:
                path = write_tiny(model_type, root, values=config_values, task=task)
            except Exception as exc:
                on_cell(model_type, Cell(NOT_TESTABLE, f"no tiny config derives from the default config: "
                                                       f"{_error(exc)}"))
                continue
            if task != CAUSAL_LM:
                try:
                    write_batches(path, model_type, _sample_count(dp), SEED)
                except Exception as exc:
                    on_cell(model_type, Cell(NOT_TESTABLE, f"no image-text batch builds for the tiny model (its "
                                                           f"image processor and placeholder tokens): {_error(exc)}"))
                    continue
            try:
                expected = _cached(os.path.join(path, f"reference-dp{dp}.pt"), reference, path, dp, 1, task)
            except RandomForward as exc:
                on_cell(model_type, Cell(NOT_TESTABLE, str(exc)))
                continue
            except Exception as exc:
                on_cell(model_type, Cell(NOT_TESTABLE, f"one process cannot train the tiny model here: "
                                                       f"{_error(exc)}"))
                continue
            if pool is None:
                pool = RankPool(nproc, log=log)
            try:
                results = pool.run(check_rank, path, sizes, dp, task, timeout=timeout)
                cell = compare(results, expected)
                if cell.verdict == FAILS and cell.worst.get("grads", float("inf")) <= 1:
                    # only later steps differ: is that more than fp32 reordering moves this model?
                    noise = _cached(os.path.join(path, f"reorder-noise-dp{dp}.pt"), reorder_noise, path, dp, expected,
                                    task)
                    cell = compare(results, expected, noise)
            except (RankError, RankTimeout) as exc:  # ranks raised apart or hung: that pool is gone
                if not owned:
                    raise
                pool = None
                cell = Cell(FAILS, f"ranks raised apart or hung: {_error(exc)}")
            cell.seconds = round(time.monotonic() - started, 1)
            on_cell(model_type, cell)
    finally:
        if owned and pool is not None:
            pool.close()
