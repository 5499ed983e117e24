"""What makes a trial reproducible and comparable: the search-space version, code, libraries, topology, data.

The space version is explicit or a hash of the ``hp_space`` function's source. A study remembers the version it
was created with; attaching with another version is refused unless the caller opts in, because the sampler would
silently mix two distributions.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import platform
import subprocess
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

import optuna

from shardadopt.upstream.versions import installed_version

ATTR_SPACE_VERSION = "space_version"
ATTR_PARAMS_HASH = "params_hash"


class SpaceVersionMismatch(RuntimeError):
    """The study was created with another search-space version."""


def space_version(hp_space: Callable[..., Any] | None, explicit: str | None = None) -> str:
    """``explicit`` if given, else a short hash of ``hp_space``'s source code."""
    if explicit:
        return str(explicit)
    if hp_space is None:
        return "none"
    try:
        source = textwrap.dedent(inspect.getsource(hp_space))
    except (OSError, TypeError) as exc:
        raise ValueError(f"cannot read the source of {hp_space!r} to version the search space ({exc}); "
                         f"pass an explicit space_version='v1'") from exc
    return "src-" + hashlib.sha256(source.encode()).hexdigest()[:12]


def check_space_version(study: optuna.Study, version: str, *, allow_mismatch: bool = False) -> None:
    """Record ``version`` on a new study; refuse an existing study created with another version."""
    recorded = study.user_attrs.get(ATTR_SPACE_VERSION)
    if recorded is None:
        others = {t.user_attrs.get(ATTR_SPACE_VERSION) for t in study.get_trials(deepcopy=False)} - {None}
        recorded = next(iter(others)) if len(others) == 1 else (sorted(others) if others else None)
    if recorded is None:
        study.set_user_attr(ATTR_SPACE_VERSION, version)
        return
    if recorded != version and not allow_mismatch:
        raise SpaceVersionMismatch(
            f"study {study.study_name!r} was created with search-space version {recorded!r}, this run has "
            f"{version!r}: its trials come from another space. Start a new study (e.g. study_name="
            f"'{study.study_name}-{version}'), or pass allow_space_mismatch=True to mix them deliberately")


def params_hash(params: Mapping[str, Any]) -> str:
    """A stable key for a parameter set: checkpoints keyed by it survive a retry under a new trial number."""
    canonical = json.dumps(dict(sorted(params.items())), sort_keys=True, default=repr)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def git_sha(path: str | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path or os.getcwd(), capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def reproducibility_attrs(*, space: str, world_size: int, topology: str | None = None,
                          data_snapshot: str | None = None) -> dict[str, Any]:
    """The user attributes every trial carries (computed once per run, not per trial)."""
    attrs: dict[str, Any] = {
        ATTR_SPACE_VERSION: space,
        "git_sha": git_sha(),
        "versions": {name: str(installed_version(name)) for name in
                     ("torch", "transformers", "accelerate", "optuna", "shardadopt")} | {
                        "python": platform.python_version()},
        "world_size": world_size,
    }
    if topology is not None:
        attrs["topology"] = topology
    if data_snapshot is not None:
        attrs["data_snapshot"] = data_snapshot
    return attrs
