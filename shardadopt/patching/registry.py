"""The patch contract and the registry that applies patches lazily and reversibly.

A patch names the upstream objects it replaces (``Target``), a version gate per upstream distribution, and a
``probe`` that inspects the installed upstream once its modules are imported. ``enable()`` never imports upstream
itself: it registers wrapt post-import hooks, so a patch is applied the moment its last target module finishes
importing (immediately, when it is already imported). Every replaced object is remembered and ``disable()`` puts
the original back, so ``getattr(owner, name) is original`` holds again afterwards.

A patch may name others it ``depends_on``: it applies only once those are ``applied`` or ``not-needed``, and is
``unsupported`` (naming the dependency) while one is off or unsupported. Every state change is logged once, on
rank 0, to the ``shardadopt`` logger at INFO, a patch that could not decide or apply at WARNING (the package adds no
handler but ``logging.NullHandler``).

Stacking: where several patches wrap one attribute, one rule orders them, whenever and in whatever order they
apply (:mod:`shardadopt.patching.stacking`). Take the registry's order (``shardadopt.patches`` registers patches
sorted by id) and move each patch after every patch it ``depends_on`` or ``wraps_around``; on a shared attribute a
patch earlier in that order wraps inside a later one (runs nearer to upstream's code). A patch whose wrapper must
see or change what another's does declares it: ``wraps_around=("<other id>",)`` on the outer one, and only for a
patch it shares a target with; everything else on a shared target must not depend on its place.

Files: a patch's fix as a change to upstream's own source is ``upstream-fixes/fixes/<id with _>.py``, its generated
diffs ``upstream-fixes/<id>.diff`` or, per upstream release, ``upstream-fixes/<id>@<release>.diff``
(``Patch.fix_file``, ``Patch.diff_files``); ``upstream`` is the hand-written status of the fix upstream, and
``PatchStatus.upstream`` adds where the diff lives.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import wrapt
from packaging.specifiers import SpecifierSet

from shardadopt import upstream
from shardadopt.patching.contract import Patch, PatchStatus
from shardadopt.patching.stacking import Stack, check_constraints, stack_order
from shardadopt.patching.states import APPLIED, NOT_NEEDED, OFF, PENDING, UNSUPPORTED
from shardadopt.upstream import Target
from shardadopt.upstream.probing import Undecided
from shardadopt.upstream.versions import installed_version

DISABLE_ENV = "SHARDADOPT_DISABLE"
logger = logging.getLogger("shardadopt")


@dataclass
class _Entry:
    patch: Patch
    state: str = OFF
    reason: str = "not enabled"
    applied: list[tuple[int, str]] = field(default_factory=list)  # keys of the Registry's stacks it joined
    blocked: bool = False  # unsupported because a dependency is off or unsupported


def version_gate(requires: dict[str, str]) -> str | None:
    """The reason the installed versions fall outside ``requires``, or None when they are inside."""
    for distribution, spec in requires.items():
        version = installed_version(distribution)
        if version is None:
            return f"{distribution} is not installed (needs {distribution}{spec})"
        if version not in SpecifierSet(spec):
            return (f"{distribution} {version} is outside the range this patch supports ({spec}); "
                    f"install a supported release: pip install '{distribution}{spec}'")
    return None


def _rank() -> int:
    """This process's rank, without importing torch (patches apply while upstream is imported)."""
    dist = sys.modules.get("torch.distributed")
    # a patch of torch.distributed's own modules applies while torch.distributed is half imported
    if dist is not None and hasattr(dist, "is_initialized") and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _ready(name: str, just_imported: ModuleType | None) -> bool:
    """Whether module ``name`` is fully imported. A module is in ``sys.modules`` while it still executes; a hook
    fired by a module it imports must not probe it half-initialised (e.g. ``accelerate.accelerator`` importing
    ``accelerate.parallelism_config``). The module whose own hook fires is complete."""
    module = sys.modules.get(name)
    if module is None:
        return False
    if module is just_imported:
        return True
    return not upstream.module_initializing(module)


def _resolve(target: Target) -> tuple[Any, str, Any]:
    """(owner, attribute, raw original) for a target whose module is imported."""
    owner: Any = sys.modules[target.module]
    *path, attribute = target.qualname.split(".")
    for name in path:
        owner = getattr(owner, name)
    # The raw class-dict entry keeps staticmethod/classmethod wrappers, so restoring it is exact.
    raw = owner.__dict__[attribute] if isinstance(owner, type) and attribute in owner.__dict__ else getattr(
        owner, attribute)
    return owner, attribute, raw


class Registry:
    """Applies a fixed list of patches, stacked on shared targets in :func:`~shardadopt.patching.stacking.stack_order`.
    The process-wide instance is :func:`process_wide` (``shardadopt.patches.process_registry()`` creates it)."""

    def __init__(self, patches: Sequence[Patch]):
        ids = [p.id for p in patches]
        duplicates = {i for i in ids if ids.count(i) > 1}
        if duplicates:
            raise ValueError(f"duplicate patch ids: {sorted(duplicates)}")
        for patch in patches:
            unknown = [d for d in patch.depends_on if d not in ids or d == patch.id]
            if unknown:
                raise ValueError(f"patch {patch.id} depends on {unknown}, which is not another registered patch")
        check_constraints(patches)
        self._rank = {pid: i for i, pid in enumerate(stack_order(patches))}
        self._stacks: dict[tuple[int, str], Stack] = {}  # (id(owner), attribute) -> what patches replaced there
        self._entries = {p.id: _Entry(p) for p in patches}
        self._lock = threading.RLock()
        self._hooked_modules: set[str] = set()
        self._enabled = False

    @property
    def ids(self) -> list[str]:
        return list(self._entries)

    def select(self, only: Iterable[str] | None, exclude: Iterable[str] | None) -> tuple[set[str], dict[str, str]]:
        """The ids to enable, and for each id left out the reason it is off."""
        only = self._checked(only, "only")
        exclude = self._checked(exclude, "exclude")
        env_off = self._env_disabled()
        off: dict[str, str] = {}
        for pid in self._entries:
            if only is not None and pid not in only:
                off[pid] = "not selected (enable(only=...))"
            elif exclude and pid in exclude:
                off[pid] = "excluded (enable(exclude=...))"
            elif pid in env_off:
                off[pid] = f"switched off by {DISABLE_ENV}"
        return set(self._entries) - set(off), off

    def enable(self, only: Iterable[str] | None = None, exclude: Iterable[str] | None = None) -> list[PatchStatus]:
        selected, off = self.select(only, exclude)
        with self._lock:
            self._enabled = True
            for pid, reason in off.items():
                self._revert(self._entries[pid], OFF, reason)
            for pid in selected:
                if self._entries[pid].state == OFF:
                    self._restart(self._entries[pid])
            unblocked = True
            while unblocked:  # a blocked patch starts again once its dependencies may apply (not while still blocked)
                unblocked = False
                for pid in selected:
                    entry = self._entries[pid]
                    if entry.blocked and not self._blocked_by(entry):
                        self._restart(entry)
                        unblocked = True
            for entry in self._entries.values():  # a dependency switched off takes its dependents with it
                blocked = self._blocked_by(entry)
                if entry.state == APPLIED and blocked:
                    self._revert(entry, UNSUPPORTED, blocked, blocked=True)
            for module in sorted({m for pid in selected for m in self._entries[pid].patch.modules}):
                self._hook(module)
            self._on_import(None)  # modules imported before this call, or hooked in an earlier enable()
            return self.status()

    def disable(self) -> list[PatchStatus]:
        with self._lock:
            self._enabled = False
            for entry in self._entries.values():
                self._revert(entry, OFF, "disabled")
            return self.status()

    def status(self) -> list[PatchStatus]:
        with self._lock:
            return [PatchStatus(e.patch.id, e.state, e.reason, e.patch.summary, e.patch.upstream_status)
                    for e in self._entries.values()]

    def patches(self) -> list[Patch]:
        return [e.patch for e in self._entries.values()]

    def stacked(self, target: Target) -> list[str]:
        """The ids of the applied patches wrapping ``target``, innermost first (empty where none is)."""
        with self._lock:
            try:
                owner, attribute, _ = _resolve(target)
            except (KeyError, AttributeError):
                return []
            stack = self._stacks.get((id(owner), attribute))
            return sorted(stack.wrappers, key=self._rank.__getitem__) if stack else []

    def stack_order(self) -> list[str]:
        """The patch ids in stacking order, innermost first (see :mod:`shardadopt.patching.stacking`)."""
        return sorted(self._rank, key=self._rank.__getitem__)

    # -- internals -------------------------------------------------------------------------------------------------

    def _checked(self, ids: Iterable[str] | None, argument: str) -> set[str] | None:
        if ids is None:
            return None
        if isinstance(ids, str):
            ids = [ids]
        ids = set(ids)
        unknown = ids - set(self._entries)
        if unknown:
            raise ValueError(f"unknown patch id(s) in {argument}: {sorted(unknown)}; valid ids: {self.ids}")
        return ids

    def _env_disabled(self) -> set[str]:
        raw = os.environ.get(DISABLE_ENV, "").strip()
        if not raw:
            return set()
        names = {n.strip() for n in raw.split(",") if n.strip()}
        if "all" in names:
            return set(self._entries)
        unknown = names - set(self._entries)
        if unknown:
            raise ValueError(f"unknown patch id(s) in {DISABLE_ENV}={raw!r}: {sorted(unknown)}; "
                             f"valid ids: {self.ids} (or 'all')")
        return names

    def _hook(self, module: str) -> None:
        # wrapt cannot unregister a hook; each module is hooked once and the callback consults current state.
        if module not in self._hooked_modules:
            self._hooked_modules.add(module)
            wrapt.register_post_import_hook(self._on_import, module)

    def _on_import(self, module: ModuleType | None) -> None:
        with self._lock:
            if not self._enabled:
                return
            progress = True
            while progress:  # a patch waiting for a dependency goes once the dependency is decided
                progress = False
                for entry in self._entries.values():
                    if entry.state != PENDING or not all(_ready(m, module) for m in entry.patch.modules):
                        continue
                    waiting = [d for d in entry.patch.depends_on if self._entries[d].state == PENDING]
                    blocked = self._blocked_by(entry)
                    if blocked:
                        self._set(entry, UNSUPPORTED, blocked, blocked=True)
                    elif waiting:
                        entry.reason = "waiting for " + ", ".join(waiting)
                        continue
                    else:
                        self._apply(entry)
                    progress = True

    def _restart(self, entry: _Entry) -> None:
        gate = version_gate(entry.patch.requires)
        if gate is not None:
            self._set(entry, UNSUPPORTED, gate)
        else:
            self._set(entry, PENDING, "waiting for " + ", ".join(
                m for m in entry.patch.modules if m not in sys.modules))

    def _blocked_by(self, entry: _Entry) -> str | None:
        """Why ``entry`` cannot apply because of a dependency, or None."""
        for dependency in entry.patch.depends_on:
            other = self._entries[dependency]
            if other.state in (OFF, UNSUPPORTED):
                return (f"needs {dependency}, which is {other.state} ({other.reason}); enable it too or "
                        f"switch this one off")
        return None

    def _set(self, entry: _Entry, state: str, reason: str, blocked: bool = False) -> None:
        changed = state != entry.state
        entry.state, entry.reason, entry.blocked = state, reason, blocked
        if changed and _rank() == 0:
            # a patch that could not decide or apply leaves upstream's code running: a warning, not a note
            level = logging.WARNING if state == UNSUPPORTED and not blocked else logging.INFO
            logger.log(level, "%s: %s (%s)", entry.patch.id, state, reason)

    def _apply(self, entry: _Entry) -> None:
        patch = entry.patch
        try:
            found = patch.probe()
        except Undecided as exc:
            self._set(entry, UNSUPPORTED, f"probe could not decide: {exc}")
            return
        except Exception as exc:  # a probe must never break the user's import
            self._set(entry, UNSUPPORTED, f"probe failed: {type(exc).__name__}: {exc}")
            return
        if not found.needed:
            self._set(entry, NOT_NEEDED, found.reason)
            return
        try:
            self._wrap(entry)
        except Exception as exc:
            self._revert(entry, UNSUPPORTED, f"could not patch: {type(exc).__name__}: {exc}")
            return
        self._set(entry, APPLIED, found.reason)

    def _wrap(self, entry: _Entry) -> None:
        # Each target's stack is rebuilt in stack order, so this wrapper lands at its place whatever applied before.
        for target, wrapper in entry.patch.wrappers.items():
            try:
                owner, attribute, original = _resolve(target)
            except (KeyError, AttributeError) as exc:
                raise AttributeError(f"{target} not found ({exc})") from exc
            key = (id(owner), attribute)
            stack = self._stacks.setdefault(key, Stack(owner, attribute, original))
            stack.wrappers[entry.patch.id] = wrapper
            entry.applied.append(key)
            stack.rebuild(self._rank)

    def _unwrap(self, entry: _Entry) -> None:
        for key in reversed(entry.applied):
            stack = self._stacks[key]
            stack.wrappers.pop(entry.patch.id, None)
            stack.rebuild(self._rank)  # the original itself once no wrapper is left
            if not stack.wrappers:
                del self._stacks[key]
        entry.applied.clear()

    def _revert(self, entry: _Entry, state: str, reason: str, blocked: bool = False) -> None:
        self._unwrap(entry)  # also a partial application that failed
        self._set(entry, state, reason, blocked)


# The registry ``shardadopt.enable()`` drives. ``shardadopt.patches.process_registry()`` builds it from the patch
# modules (which import this module, so it cannot be built here) and hands it over; ``shardadopt.patching.refusal``
# reads it here.
_PROCESS_WIDE: Registry | None = None


def process_wide() -> Registry | None:
    """The process-wide registry, or None before ``shardadopt`` created it."""
    return _PROCESS_WIDE


def make_process_wide(registry: Registry) -> Registry:
    """Make ``registry`` the process-wide one (``shardadopt.patches.process_registry()`` does, once).

    Args:
        registry: the registry of every patch shardadopt ships.

    Returns:
        ``registry``.
    """
    global _PROCESS_WIDE
    _PROCESS_WIDE = registry
    return registry
