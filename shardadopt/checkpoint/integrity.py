"""Per-file sizes and checksums in the completion marker, checked before anything is loaded; one error on every rank.

At save, once every rank wrote its files, the ranks hash the staging directory between them (file ``i`` on rank
``i % world``) and rank 0 writes ``{file: {size, sha256}}`` into the marker, sealed by a checksum of the marker
itself. At load every rank checks every file's size and hashes its share, then the ranks exchange what they found
(one ``all_gather_object`` under a fence, so a rank that hangs or fails bounds everyone's wait): every rank raises
the same ``DamagedCheckpointError`` naming the first damaged file, or none does. A file that differs from its
checksum was damaged or comes from another save (two checkpoint directories mixed); so does a file under ``state/``
that the marker does not list. Markers written before checksums (shardadopt 0.1.0) load with a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

from shardadopt.checkpoint.errors import CheckpointError, DamagedCheckpointError, UntrustedCheckpointError
from shardadopt.checkpoint.safeload import damaged, load_file
from shardadopt.fence import fenced, progress
from shardadopt.parallel.topology import rank_and_world_size

FILES = "files"  # the marker's per-file record
SEAL = "marker_sha256"  # the marker's checksum of itself
_CHUNK = 8 << 20
_AGREED = "shardadopt_agreed"  # set on an error every rank raises alike


def digest(path: str) -> str:
    """The sha256 of a file, read in chunks, as hex."""
    sha = hashlib.sha256()
    buffer = memoryview(bytearray(_CHUNK))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            sha.update(buffer[:n])
    return sha.hexdigest()


def _listing(directory: str, skip: str) -> list[str]:
    """Every regular file under ``directory`` (relative, ``/``-separated, sorted), but ``skip``."""
    out = []
    for root, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/")
            if rel != skip:
                out.append(rel)
    return sorted(out)


def _all_gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    world_size = rank_and_world_size()[0]
    if world_size == 1:
        return [value]
    progress()
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


def manifest(staging: str, marker: str) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file in ``staging`` but ``marker``; every rank calls it (a collective) once all
    files are written, and hashes its share.

    Args:
        staging: the staging directory of a save (the same path on every rank).
        marker: the marker's file name, left out.

    Returns:
        ``{file: {"size": bytes, "sha256": hex}}``, the same on every rank.
    """
    world_size, rank = rank_and_world_size()
    names = _all_gather(_listing(staging, marker) if rank == 0 else None)[0]  # rank 0's listing, for all
    mine = {}
    for name in names[rank::world_size]:
        path = os.path.join(staging, name)
        mine[name] = {"size": os.path.getsize(path), "sha256": digest(path)}
        progress()
    files: dict[str, dict[str, Any]] = {}
    for part in _all_gather(mine):
        files.update(part)
    return files


def _sealed_content(marker: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in marker.items() if k != SEAL}, sort_keys=True, default=str)


def seal(marker: dict[str, Any]) -> dict[str, Any]:
    """``marker`` with its own checksum added (over its JSON, keys sorted)."""
    marker = json.loads(json.dumps(marker, default=str))  # as it reads back
    marker[SEAL] = hashlib.sha256(_sealed_content(marker).encode()).hexdigest()
    return marker


def check_seal(directory: str, name: str, marker: Any) -> None:
    """Raise ``DamagedCheckpointError`` when ``marker`` (read from ``directory/name``) is not a JSON object or
    differs from its own checksum; a marker without one (written before checksums) passes."""
    if not isinstance(marker, dict):
        raise damaged(directory, name, f"it holds a JSON {type(marker).__name__}, not an object")
    if SEAL in marker and hashlib.sha256(_sealed_content(marker).encode()).hexdigest() != marker[SEAL]:
        raise damaged(directory, name, "its content does not match its checksum")


def _local_problems(directory: str, files: dict[str, dict[str, Any]], state_dir: str) -> list[tuple[str, str]]:
    """(file, what is wrong) for each damaged file this rank finds: every file's size, its share's sha256, and
    files under ``state_dir`` the marker does not list."""
    world_size, rank = rank_and_world_size()
    names = sorted(files)
    problems = []
    for name in names:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append((name, "it is missing"))
        elif os.path.getsize(path) != files[name].get("size"):
            problems.append((name, f"{os.path.getsize(path)} bytes, {files[name].get('size')} were saved"))
    state_files = _listing(os.path.join(directory, state_dir), "") if os.path.isdir(
        os.path.join(directory, state_dir)) else []
    problems += [(f"{state_dir}/{n}", "this save did not write it: it comes from another checkpoint")
                 for n in state_files if f"{state_dir}/{n}" not in files]
    damaged_names = {p[0] for p in problems}
    for name in names[rank::world_size]:
        if name not in damaged_names and digest(os.path.join(directory, name)) != files[name].get("sha256"):
            problems.append((name, "its content differs from what this save wrote (damaged, or from another save)"))
        progress()
    return problems


def agreed(local: CheckpointError | None) -> CheckpointError | None:
    """The error every rank raises, given what this rank found (a collective: every rank calls it).

    Args:
        local: this rank's ``DamagedCheckpointError`` / ``UntrustedCheckpointError``, or None.

    Returns:
        The one with the first file name over all ranks (the same on every rank, marked agreed), or None.
    """
    found = [f for f in _all_gather(None if local is None else (type(local).__name__, str(local),
                                                                   local.directory, local.file)) if f]
    if not found:
        return None
    kind, message, directory, file = min(found, key=lambda f: (f[3], f[1]))
    error_type = UntrustedCheckpointError if kind == UntrustedCheckpointError.__name__ else DamagedCheckpointError
    error = error_type(message, directory, file)
    setattr(error, _AGREED, True)
    return error


def verify(directory: str, files: dict[str, dict[str, Any]] | None, state_dir: str) -> None:
    """Check the files of checkpoint ``directory`` against the marker's ``files`` before anything is loaded; every
    rank calls it inside :func:`agreement` and raises the same ``DamagedCheckpointError``, or none does.

    Args:
        directory: the checkpoint directory.
        files: the marker's per-file record; None for a checkpoint written before checksums (a warning).
        state_dir: the DCP directory inside it.
    """
    if files is None:
        warnings.warn(f"{directory} was written before shardadopt recorded file checksums: a damaged file is found "
                      f"only when it is read (save again to record them)", stacklevel=3)
        return
    found = sorted(set().union(*_all_gather(_local_problems(directory, files, state_dir))))
    if found:
        name, detail = found[0]
        others = sorted({n for n, _ in found} - {name})
        if others:
            detail += (f"; {len(others)} other files differ from the marker too ({', '.join(others[:3])}"
                       f"{', ...' if len(others) > 3 else ''}): were files of two saves, or a marker of another, "
                       f"mixed?")
        raise mark_agreed(damaged(directory, name, detail))


def read_agreed(directory: str, names: dict[str, str], hints: dict[str, str] | None = None) -> dict[str, Any]:
    """Read the files ``names`` (file -> what it holds) of ``directory`` that exist, with ``weights_only=True``, on
    this rank; every rank calls it inside :func:`agreement` and raises the same error when any rank could not read
    one (a file read by one rank only, its RNG file, included).

    Args:
        directory: the checkpoint directory.
        names: the files this rank reads, each with what it holds (for the error message).
        hints: what to do when a file holds a type ``weights_only`` refuses, per file (default: it was altered).

    Returns:
        What each existing file holds.
    """
    found, problem = {}, None
    try:
        for name, what in names.items():
            if os.path.isfile(os.path.join(directory, name)):
                found[name] = load_file(directory, name, what, hint=(hints or {}).get(name))
    except CheckpointError as exc:
        problem = exc
    error = agreed(problem)
    if error is not None:
        raise error
    return found


@contextlib.contextmanager
def agreement(what: str) -> Iterator[None]:
    """A load under a fence: every rank leaves it within the fence's bound; an error the ranks agreed on
    (:func:`agreed`) is raised on every rank after the fence is left, so the process groups stay usable for
    loading another checkpoint. Any other error breaks every rank out (``PeerFailedError`` on the others).

    Args:
        what: the load, as the fence's messages name it.
    """
    error = None
    with fenced(what):
        try:
            yield
        except CheckpointError as exc:
            if not getattr(exc, _AGREED, False):
                raise
            error = exc
    if error is not None:
        raise error.with_traceback(None)


def mark_agreed(error: CheckpointError) -> CheckpointError:
    """``error`` marked as raised alike on every rank (its cause is the same on all: a collective's result)."""
    setattr(error, _AGREED, True)
    return error
