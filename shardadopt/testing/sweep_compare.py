"""The architecture sweep's verdict on one type and layout: every rank's results against the one-process reference.

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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardadopt.testing.archs import CAUSAL_LM
from shardadopt.testing.sweep_run import LR, reference

VERIFIED = "verified"
REFUSED_UPSTREAM = "refused upstream"
REFUSED_SHARDADOPT = "refused by shardadopt"
FAILS = "fails"
NOT_TESTABLE = "not testable here"
VERDICTS = (VERIFIED, REFUSED_UPSTREAM, REFUSED_SHARDADOPT, FAILS, NOT_TESTABLE)

# Final parameters: the selftest's rule for this LR (shardadopt.selftest.accelerate says why).
PARAM_MAX_DIFF = 0.5 * LR
PARAM_RMS = 1e-3 * LR
GRAD_RTOL = 1e-4
GRAD_FLOOR = 1e-2
STEP_RTOL = 1e-4
NOISE_FACTOR = 10


@dataclass
class Cell:
    verdict: str
    detail: str = ""
    worst: dict[str, float] = field(default_factory=dict)  # measured error / tolerance, per quantity
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "detail": self.detail, "worst": self.worst, "seconds": self.seconds}


def reorder_noise(path: str, dp: int, expected: dict[str, Any], task: str = CAUSAL_LM) -> dict[str, Any] | None:
    """:func:`reference` with each micro-batch in two chunks when that is only a reordering (its first-step
    gradients within the gradient tolerance of ``expected``), else None (batch-dependent math, e.g.
    capacity-limited routing)."""
    reordered = reference(path, dp, split=2, task=task)
    return reordered if _grad_ratio([reordered["grads"]], expected["grads"])[0] <= 1 else None


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
