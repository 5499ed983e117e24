"""``save`` and ``load``: the plain checkpoint API, with every read checked before anything is loaded.

``load`` reads the marker, checks every file against the sizes and checksums it records (``integrity``), reads the
schedulers', ``extra`` and RNG states safely (``safeload``) and only then loads the model and optimizer through DCP
and applies the rest. A damaged or untrusted file is one error raised alike on every rank, after the load's fence is
left (the process groups stay usable: load an earlier checkpoint instead).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from shardadopt.checkpoint.errors import CheckpointError, CheckpointMismatchError
from shardadopt.checkpoint.integrity import agreed, agreement, mark_agreed, verify
from shardadopt.checkpoint.publish import STATE_DIR, CheckpointInfo, read_info, staged
from shardadopt.checkpoint.rng import read_rng_state, restore_rng_state, save_rng_state
from shardadopt.checkpoint.safeload import EXTRA_HINT, damaged, load_file
from shardadopt.checkpoint.state import as_list, check_compatible, load_sharded_state, save_sharded_state
from shardadopt.parallel.topology import rank_and_world_size

SCHEDULERS = "schedulers.pt"
EXTRA = "extra.pt"


def save(directory: str | os.PathLike, model: torch.nn.Module | Sequence[torch.nn.Module],
         optimizer: Any = None, scheduler: Any = None, *, step: int | None = None, extra: Any = None,
         rng: bool = True, metadata: dict[str, Any] | None = None) -> str:
    """Save a resumable checkpoint into ``directory`` atomically; every rank must call it. Returns the directory.

    ``model``/``optimizer``/``scheduler`` may be lists (one optimizer per model, or several for one model).
    ``extra`` (dataloader position, counters) is saved from rank 0 with ``torch.save``; ``load`` reads it back with
    ``weights_only=True``: tensors, numbers, strings, None and lists, tuples and dicts of them (other objects only
    with ``load(..., trust_extra=True)``). ``metadata`` (JSON-able) goes into the completion marker, with every
    file's size and checksum.

    Args:
        directory: where the checkpoint is published (the same path on every rank).
        model: the model, or a list of models.
        optimizer: an optimizer, or a list.
        scheduler: a learning-rate scheduler, or a list.
        step: the training step, recorded in the completion marker.
        extra: an object saved from rank 0 (see above for what loads without ``trust_extra``).
        rng: whether to save every rank's RNG states.
        metadata: JSON-able values for the completion marker.

    Returns:
        ``directory``, as a string.
    """
    models = as_list(model)
    with staged(directory, step=step, models=models, metadata=metadata) as stage:
        save_sharded_state(stage, models, optimizer)
        if rank_and_world_size()[1] == 0:
            schedulers = as_list(scheduler)
            if schedulers:
                torch.save([s.state_dict() for s in schedulers], os.path.join(stage, SCHEDULERS))
            if extra is not None:
                torch.save(extra, os.path.join(stage, EXTRA))
        if rng:
            save_rng_state(stage)
    return os.path.abspath(os.fspath(directory))


def _read_local(info: CheckpointInfo, schedulers: list, rng: bool, trust_extra: bool) -> dict[str, Any]:
    """The schedulers', ``extra`` and this rank's RNG states, read safely (nothing applied yet)."""
    found: dict[str, Any] = {}
    if schedulers:
        states = load_file(info.directory, SCHEDULERS, "the schedulers' states")
        if not isinstance(states, list):
            raise damaged(info.directory, SCHEDULERS, f"it holds a {type(states).__name__}, not a list of states")
        found["schedulers"] = states
    if os.path.isfile(os.path.join(info.directory, EXTRA)):
        found["extra"] = load_file(info.directory, EXTRA, "extra", trusted=trust_extra, hint=EXTRA_HINT)
    if rng and not info.resharded:
        found["rng"] = read_rng_state(info.directory)
    return found


def load(directory: str | os.PathLike, model: torch.nn.Module | Sequence[torch.nn.Module], optimizer: Any = None,
         scheduler: Any = None, *, rng: bool = True, reshard: bool = True,
         trust_extra: bool = False) -> CheckpointInfo:
    """Load a checkpoint written by ``save`` into the given objects; every rank must call it.

    Refuses an incomplete checkpoint (``IncompleteCheckpointError``). Before anything is loaded, every file is
    checked against the sizes and checksums the marker records: a damaged, missing or foreign file (from another
    save) is ``DamagedCheckpointError`` on every rank, naming the directory and the file. Nothing in a checkpoint
    runs code: DCP's metadata, the schedulers', RNG and ``extra`` states are read with ``weights_only=True``
    (``UntrustedCheckpointError`` names a file holding other types). With the same world size and layout it
    restores everything, per-rank RNG included. With a different layout it reshards the weights and optimizer
    state through DCP (``info.resharded``) and leaves the RNG alone, with a warning; ``reshard=False`` refuses
    instead (``CheckpointMismatchError``).

    Args:
        directory: a checkpoint written by :func:`save` (e.g. ``latest(root)``).
        model: the model, or a list of models, as saved.
        optimizer: an optimizer, or a list, as saved.
        scheduler: a scheduler, or a list, as saved.
        rng: whether to restore the RNG states (same layout only).
        reshard: whether a checkpoint saved with another layout may be resharded.
        trust_extra: read ``extra`` with full pickle (``weights_only=False``), for objects other than tensors,
            numbers, strings and containers of them. Loading such a file runs any code it holds: only for a
            checkpoint whose writer you trust.

    Returns:
        The checkpoint's :class:`CheckpointInfo` (``step``, ``extra``, ``resharded``, ...).
    """
    info = read_info(directory)
    models = as_list(model)
    info.resharded = check_compatible(info, models, reshard=reshard)
    schedulers = as_list(scheduler)
    with agreement(f"the checkpoint load from {info.directory}"):
        verify(info.directory, info.files, STATE_DIR)
        try:
            found, problem = _read_local(info, schedulers, rng, trust_extra), None
        except CheckpointError as exc:  # damaged or untrusted: every rank learns it before anything is loaded
            found, problem = {}, exc
        error = agreed(problem)
        if error is not None:
            raise error
        if len(found.get("schedulers", schedulers)) != len(schedulers):
            raise mark_agreed(CheckpointMismatchError(
                f"{info.directory} holds {len(found['schedulers'])} scheduler(s), {len(schedulers)} given"))
        load_sharded_state(info.directory, models, optimizer)
    for s, state in zip(schedulers, found.get("schedulers", [])):
        s.load_state_dict(state)
    info.extra = found.get("extra")
    if found.get("rng") is not None:
        restore_rng_state(found["rng"], info.directory)
        info.rng_restored = True
    elif rng and info.resharded:
        warnings.warn(f"{info.directory} was saved with world size {info.world_size} and a different layout: the "
                      f"weights and optimizer state were resharded, the per-rank RNG states were not restored",
                      stacklevel=2)
    return info
