"""Atomic publication: a staging directory beside the target, a completion marker, one rename into place.

Everything is written into a hidden staging directory next to the target; only after every rank has finished (a
barrier) does rank 0 write the marker and rename the staging directory into place. A crash mid-save leaves a
staging directory, never a directory that loads as complete: ``read_info`` refuses a directory without the marker,
and ``latest`` skips it. The save runs under a fault fence (``shardadopt.fence``): one rank raising makes every
rank raise at once (``PeerFailedError`` naming it on the others) and nothing is published.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardadopt.checkpoint.errors import CheckpointError, DamagedCheckpointError, IncompleteCheckpointError
from shardadopt.checkpoint.integrity import FILES, check_seal, manifest, seal
from shardadopt.checkpoint.safeload import damaged
from shardadopt.checkpoint.sharding import barrier, layout
from shardadopt.fence import fenced
from shardadopt.fence.errors import summary
from shardadopt.parallel.topology import rank_and_world_size

MARKER = "shardadopt_checkpoint.json"
FORMAT = 1
STATE_DIR = "state"  # the DCP files
_STAGING_SUFFIX = ".partial"


@dataclass
class CheckpointInfo:
    """What a checkpoint's completion marker records, plus what ``load`` did."""

    directory: str
    step: int | None
    world_size: int
    layouts: list[dict[str, Any]]
    versions: dict[str, str]
    metadata: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] | None = None  # size and sha256 per file; None: written before checksums
    extra: Any = None
    resharded: bool = False
    rng_restored: bool = False


def _versions() -> dict[str, str]:
    import importlib.metadata

    out = {}
    for name in ("torch", "transformers", "accelerate", "shardadopt"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def staging_path(directory: str) -> str:
    parent, name = os.path.split(os.path.abspath(directory))
    return os.path.join(parent, f".{name}{_STAGING_SUFFIX}")


def _aside_path(directory: str) -> str:
    """Where a same-name re-save moves the previous ``directory`` between its two renames."""
    return f"{staging_path(directory)}.old"


def _recover_aside(directory: str) -> None:
    """Put back the previous checkpoint a same-name re-save moved aside and was killed before replacing (rank 0 of
    the next save of that name, before it writes anything).

    Between its two renames ``_publish`` leaves ``directory`` absent and its previous content at the aside path:
    a crash there must not lose it, nor let the next save delete it. Readers only look there (``read_info``,
    ``latest``): they never rename, so a job reading a run's checkpoints cannot break that run's save.
    """
    aside = _aside_path(directory)
    if not os.path.exists(directory) and os.path.isdir(aside):
        os.rename(aside, directory)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged(directory: str | os.PathLike, *, step: int | None = None, models: Sequence[torch.nn.Module] = (),
           metadata: dict[str, Any] | None = None,
           after_publish: Callable[[], None] | None = None) -> Iterator[str]:
    """Yield a staging directory to write a checkpoint into; publish it as ``directory`` once every rank is done.

    Every rank must enter and leave the block. On normal exit: a barrier (all ranks finished writing), then rank 0
    writes the completion marker and renames the staging directory to ``directory`` (replacing an older one of the
    same name), then a barrier so no rank reads before publication. If the block raises, nothing is published.
    ``after_publish`` (every rank calls it, e.g. rotating older checkpoints on rank 0) runs after publication,
    still under the fence, followed by a barrier: one rank raising there makes every rank raise at once.

    Args:
        directory: where the checkpoint is published.
        step: the training step, recorded in the completion marker.
        models: the models saved, whose layout the marker records.
        metadata: JSON-able values for the completion marker.
        after_publish: called on every rank after publication.

    Yields:
        The staging directory to write into (the same path on every rank).
    """
    directory = os.path.abspath(os.fspath(directory))
    with fenced(f"the checkpoint save into {directory}"):  # a rank raising anywhere in here: every rank raises
        staging = staging_path(directory)
        world_size, rank = rank_and_world_size()
        if rank == 0:
            _recover_aside(directory)  # before anything of this save can replace or remove it
            shutil.rmtree(staging, ignore_errors=True)  # left by an earlier crash
            os.makedirs(staging)
        barrier()
        yield staging
        barrier()
        files = manifest(staging, MARKER)  # every rank hashes its share of the files, once all are written
        if rank == 0:
            _publish(staging, directory, step, world_size, models, metadata, files)
        barrier()
        if after_publish is not None:
            after_publish()
            barrier()  # no rank reads what it removes


def _publish(staging: str, directory: str, step: int | None, world_size: int, models: Sequence[torch.nn.Module],
             metadata: dict[str, Any] | None, files: dict[str, dict[str, Any]]) -> None:
    """Rank 0, once every rank wrote its part: the completion marker (sealed, with every file's size and
    checksum), then one rename into place."""
    marker = seal({"format": FORMAT, "complete": True, "step": step, "world_size": world_size,
                   "layouts": [layout(m) for m in models], "versions": _versions(), "time": time.time(),
                   "metadata": metadata or {}, FILES: files})
    path = os.path.join(staging, MARKER)
    with open(path, "w") as f:
        json.dump(marker, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(staging)
    old = None
    if os.path.exists(directory):  # re-saving the same name: move the old one aside, then drop it
        old = _aside_path(directory)
        shutil.rmtree(old, ignore_errors=True)  # a leftover of a crash after the second rename: directory is newer
        os.rename(directory, old)
    os.rename(staging, directory)
    _fsync_dir(os.path.dirname(directory))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def is_complete(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a completely written shardadopt checkpoint.

    Args:
        directory: a checkpoint directory.

    Returns:
        True when its completion marker is there.
    """
    return os.path.isfile(os.path.join(os.fspath(directory), MARKER))


def read_info(directory: str | os.PathLike) -> CheckpointInfo:
    """The completion marker of ``directory``; ``IncompleteCheckpointError`` when it is missing.

    Where a re-save of ``directory`` was killed between its two renames, the previous checkpoint is read where that
    save moved it (``info.directory``) until the next save of that name puts it back.

    Args:
        directory: a checkpoint directory.

    Returns:
        Its :class:`CheckpointInfo`.
    """
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory) and is_complete(_aside_path(directory)):
        directory = _aside_path(directory)
    if not os.path.isdir(directory):
        raise IncompleteCheckpointError(f"checkpoint directory {directory} does not exist")
    path = os.path.join(directory, MARKER)
    if not os.path.isfile(path):
        partial = os.path.basename(directory).endswith(_STAGING_SUFFIX) or os.path.isdir(
            os.path.join(directory, STATE_DIR))
        what = ("a save into it was interrupted before every rank finished" if partial
                else "it was not written by shardadopt.checkpoint")
        root = os.path.dirname(directory)
        found = latest(root)
        hint = (f"the latest complete checkpoint under {root} is {found}" if found
                else f"there is no complete checkpoint under {root}")
        raise IncompleteCheckpointError(
            f"{directory} is not a complete checkpoint (no completion marker {MARKER}): {what}. "
            f"Resume from a complete one instead ({hint}; shardadopt.checkpoint.latest(root) finds it).")
    try:
        with open(path, "rb") as f:
            marker = json.loads(f.read().decode())
    except (ValueError, OSError) as exc:  # truncated, not UTF-8, unreadable
        raise damaged(directory, MARKER, summary(exc)) from exc
    check_seal(directory, MARKER, marker)
    if marker.get("format") != FORMAT:
        raise CheckpointError(f"{directory} has checkpoint format {marker.get('format')}, this shardadopt reads "
                              f"format {FORMAT}; load it with the shardadopt version that wrote it "
                              f"({marker.get('versions', {}).get('shardadopt', 'unknown')})")
    try:
        return CheckpointInfo(directory=directory, step=marker.get("step"), world_size=int(marker["world_size"]),
                              layouts=marker.get("layouts", []), versions=marker.get("versions", {}),
                              metadata=marker.get("metadata", {}), files=marker.get(FILES))
    except (KeyError, TypeError, ValueError) as exc:
        raise damaged(directory, MARKER, f"no world size: {summary(exc)}") from exc


def latest(root: str | os.PathLike) -> str | None:
    """The complete checkpoint directly under ``root`` with the highest step (then the newest); None if none.

    Staging directories of interrupted saves, directories without a completion marker and those whose marker is
    damaged (a warning) are skipped; a checkpoint
    that a same-name re-save moved aside and was killed before replacing counts, at the path it was moved to.

    Args:
        root: the directory holding the checkpoints.

    Returns:
        The path of the newest complete checkpoint, or None.
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    aside_suffix = f"{_STAGING_SUFFIX}.old"
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        moved_aside = name.startswith(".") and name.endswith(aside_suffix) and not os.path.exists(
            os.path.join(root, name[1:-len(aside_suffix)]))
        if (name.startswith(".") and not moved_aside) or not is_complete(path):
            continue
        try:
            info = read_info(path)
        except DamagedCheckpointError as exc:
            warnings.warn(f"skipping {path}: {exc}", stacklevel=2)
            continue
        found.append((info.step if info.step is not None else -1, os.path.getmtime(os.path.join(path, MARKER)),
                      path))
    return max(found)[2] if found else None


def _stale_weights(directory: str, written: set[str]) -> list[str]:
    """Weight files of an earlier export in ``directory`` that this one does not write: ``model*.safetensors`` and
    its index (a plain ``from_pretrained`` prefers a single ``model.safetensors`` over a new sharded index)."""
    from huggingface_hub import constants

    single, index = constants.SAFETENSORS_SINGLE_FILE, constants.SAFETENSORS_INDEX_FILE
    stem, suffix = os.path.splitext(single)
    return [name for name in os.listdir(directory) if name not in written
            and (name == index or (name.startswith(stem) and name.endswith(suffix)))
            and os.path.isfile(os.path.join(directory, name))]


def publish_files(staging: str, directory: str, weights: list[str]) -> list[str]:
    """Move the finished files of ``save_full`` into ``directory``, each with one rename (weights before the index
    and config that name them), so a reader never sees a partly written file; weight files of an earlier export
    that this one does not write are removed before the index and config that describe the new ones arrive."""
    os.makedirs(directory, exist_ok=True)
    names = os.listdir(staging)
    for name in [n for n in names if n in weights]:
        os.replace(os.path.join(staging, name), os.path.join(directory, name))
    for name in _stale_weights(directory, set(names)):
        os.remove(os.path.join(directory, name))
    for name in [n for n in names if n not in weights]:
        os.replace(os.path.join(staging, name), os.path.join(directory, name))
    _fsync_dir(directory)
    shutil.rmtree(staging, ignore_errors=True)
    return [os.path.join(directory, name) for name in weights]
