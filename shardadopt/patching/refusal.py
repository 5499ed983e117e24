"""Refuse to train a load-time-sharded model on plain upstream where a fix it needs could not apply.

On a release newer than the tested range a patch whose probe finds neither upstream's broken shape nor its fixed
one is ``unsupported``: upstream's own code runs. For a patch whose ``needed_by`` says a model needs it (its TP
gradient hooks, its expert parallelism) that would train silently wrong, so the adoption path raises instead,
naming the patch, why it did not apply, and how to go on.
"""

from __future__ import annotations

from typing import Any

from shardadopt.patching.registry import UNSUPPORTED, PatchStatus, process_wide
from shardadopt.upstream.versions import newer_than_tested

__all__ = ["UnfixedUpstreamError", "unfixed_possible", "unfixed_patches", "refuse_unfixed"]


class UnfixedUpstreamError(RuntimeError):
    """A load-time-sharded model needs a fix that could not apply on the installed upstream."""


def unfixed_possible() -> bool:
    """Whether any patch that declares ``needed_by`` is ``unsupported`` (cheap: no model is looked at)."""
    registry = process_wide()
    if registry is None:  # shardadopt never created its registry: no patch ran, none failed to apply
        return False
    unsupported = {s.id for s in registry.status() if s.state == UNSUPPORTED}
    return any(patch.needed_by is not None and patch.id in unsupported for patch in registry.patches())


def unfixed_patches(model: Any, layout: Any) -> list[PatchStatus]:
    """The ``unsupported`` patches whose ``needed_by`` says ``model`` (laid out as ``layout``) needs them."""
    registry = process_wide()
    if registry is None:
        return []
    states = {s.id: s for s in registry.status()}
    return [states[patch.id] for patch in registry.patches()
            if states[patch.id].state == UNSUPPORTED and patch.needed_by is not None
            and patch.needed_by(model, layout)]


def refuse_unfixed(model: Any, layout: Any) -> None:
    """Raise :class:`UnfixedUpstreamError` when ``model`` needs a patch that is ``unsupported``.

    Args:
        model: a model sharded at load time (or by hand).
        layout: its ``shardadopt.parallel.topology`` result.
    """
    unfixed = unfixed_patches(model, layout)
    if not unfixed:
        return
    newer = ", ".join(f"{name} {version}" for name, version in newer_than_tested().items())
    reasons = "; ".join(f"{s.id}: {s.reason}" for s in unfixed)
    ids = [s.id for s in unfixed]
    raise UnfixedUpstreamError(
        f"this model ({layout.describe()}) needs shardadopt's fix {', '.join(ids)}, which could not apply on the "
        f"installed upstream{f' ({newer}, newer than the tested range)' if newer else ''}: {reasons}. Training it on "
        f"upstream's code as it is would give wrong gradients. Install a tested release (`shardadopt doctor` lists "
        f"them), or accept upstream's behaviour explicitly with shardadopt.enable(exclude={ids!r}).")
