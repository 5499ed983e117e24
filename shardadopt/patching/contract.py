"""The patch contract: what every patch module declares (``PATCH = Patch(...)``) and what a probe returns.

A module in ``shardadopt/patches/`` named after its patch id (``-`` -> ``_``) defines ``PATCH``; the registry
(:mod:`shardadopt.patching.registry`) finds it there, applies it and reports a :class:`PatchStatus` for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardadopt.upstream import Target

# Where each patch's upstream fix and its diffs live in the repository (the registry module docstring).
UPSTREAM_FIXES_DIR = "upstream-fixes"
FIXES_DIR = f"{UPSTREAM_FIXES_DIR}/fixes"

# A wrapper in wrapt's convention: wrapper(wrapped, instance, args, kwargs).
Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]


@dataclass(frozen=True)
class Probe:
    """What a probe found: whether the installed upstream still needs the patch, and why."""

    needed: bool
    reason: str


@dataclass
class Patch:
    """One fix for one upstream shortcoming.

    ``requires`` maps a distribution name to the version range the patch was written and tested against; outside
    it the patch is ``unsupported``. Inside it, ``probe()`` decides (upstream backports fixes, so versions alone go
    stale). ``wrappers`` maps each target to the wrapt wrapper that replaces it. ``upstream`` says where the fix
    stands upstream in words ("proposal for transformers main (not reported yet)"); the files are named after the
    id (``fix_file``, ``diff_files``), not written there.
    """

    id: str
    summary: str
    upstream: str
    requires: dict[str, str]
    wrappers: dict[Target, Wrapper]
    probe: Callable[[], Probe]
    # Modules that must be imported before the probe can look (defaults to the targets' modules).
    probe_modules: tuple[str, ...] = ()
    # Patches this one only works on top of (each must be applied or not-needed first).
    depends_on: tuple[str, ...] = ()
    # (model, topology) -> whether a model sharded at load time needs this fix to train right; such a model is
    # refused at accelerate prepare / Trainer while the patch is unsupported (shardadopt.patching.refusal).
    needed_by: Callable[[Any, Any], bool] | None = None
    # Patches whose wrappers this patch's wrap, on the targets they share (shardadopt.patching.stacking).
    wraps_around: tuple[str, ...] = ()

    @property
    def targets(self) -> tuple[Target, ...]:
        return tuple(self.wrappers)

    @property
    def fix_file(self) -> str:
        """The fix as a change to upstream's source, relative to the repository (``tools/upstream_diffs.py``)."""
        return f"{FIXES_DIR}/{self.id.replace('-', '_')}.py"

    @property
    def diff_files(self) -> str:
        """The diffs built from :attr:`fix_file`: one file, or one per upstream release the fix differs in."""
        return f"{UPSTREAM_FIXES_DIR}/{self.id}[@<release>].diff"

    @property
    def upstream_status(self) -> str:
        """What ``status()`` and ``shardadopt doctor --json`` show as the patch's ``upstream``: status and diff."""
        return f"{self.upstream}; {self.diff_files}"

    @property
    def modules(self) -> tuple[str, ...]:
        names = [t.module for t in self.wrappers] + list(self.probe_modules)
        return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class PatchStatus:
    id: str
    state: str
    reason: str
    summary: str = ""
    upstream: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"id": self.id, "state": self.state, "reason": self.reason, "summary": self.summary,
                "upstream": self.upstream}
