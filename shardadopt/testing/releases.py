"""Whether the installed upstream is newer than every release the project recorded data for.

CI's newest set installs transformers and accelerate as they are published. A test that compares the installation
with recorded data (the release matrix, the architecture matrix, the diffs) skips on a release newer than the newest
recorded one, naming it, instead of failing every submission until someone records it: the probes decide there,
the behavioural tests still run, and ``.ci/newest`` reports what moved.
"""

from __future__ import annotations

from collections.abc import Iterable

from packaging.version import Version

from shardadopt.upstream.versions import installed_version


def newer_than_recorded(distribution: str, recorded: Iterable[str]) -> str | None:
    """Why tests of recorded data skip here, or None when they apply.

    Args:
        distribution: the upstream distribution (``"transformers"``, ``"accelerate"``).
        recorded: the releases (or release lines, ``"5.25"``) the data was recorded on.

    Returns:
        A skip reason when the installed release line is newer than every recorded one, else None.
    """
    installed = installed_version(distribution)
    lines = [Version(v).release[:2] for v in recorded]
    if installed is None or not lines or installed.release[:2] <= max(lines):
        return None
    newest = ".".join(map(str, max(lines)))
    return (f"{distribution} {installed} is newer than the recorded data (newest {newest}): the probes decide on "
            f"it; .ci/newest reports what moved, and tools/release_matrix.py / tools/arch_sweep.py record it")
