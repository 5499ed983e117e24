"""Resumable distributed checkpoints and full-weight export for models sharded at load time (or by hand).

    from shardadopt import checkpoint
    checkpoint.save("out/step-200", model, optimizer, scheduler, step=200)        # every rank calls it
    info = checkpoint.load(checkpoint.latest("out"), model, optimizer, scheduler)  # in a fresh run
    checkpoint.save_full(model, "out/final")                                      # plain from_pretrained loads it

A checkpoint is one directory: model and optimizer state written by ``torch.distributed.checkpoint`` (each rank
writes its own shards), the schedulers and ``extra`` from rank 0, one RNG file per rank (python, numpy, torch),
and a completion marker ``shardadopt_checkpoint.json`` (world size, each model's layout, versions, step, every
file's size and sha256). Loading runs nothing from the checkpoint (``safeload``) and checks every file first
(``integrity``): a damaged one is ``DamagedCheckpointError`` on every rank.

Parts: ``publish`` (staging, atomic rename, completion marker, ``latest``), ``resume`` (``save``/``load``),
``state`` (DCP state, resharding), ``integrity`` (checksums, agreement), ``safeload`` (reads that run no code),
``errors``, ``rng`` (per-rank RNG), ``export`` (``save_full``/``full_state_dict``), ``sharding`` (layout
detection); ``accelerator`` and ``trainer`` hold what the ``accelerate-sharded-checkpoint`` and
``trainer-sharded-checkpoint`` patches call.

One rank raising inside a save: every rank raises at once (``PeerFailedError`` naming that rank on the others; in
DCP's writes too: DCP's ``CheckpointException`` does not leave a save), nothing is published, and the previous
complete checkpoint still loads (in a new job, or after ``shardadopt.fence.rebuild_world()``: the fence leaves the
process groups unusable).
"""

from __future__ import annotations

from shardadopt.checkpoint.errors import (
                                          CheckpointError,
                                          CheckpointMismatchError,
                                          DamagedCheckpointError,
                                          IncompleteCheckpointError,
                                          UntrustedCheckpointError,
)
from shardadopt.checkpoint.export import full_state_dict, save_full
from shardadopt.checkpoint.publish import FORMAT, MARKER, CheckpointInfo, is_complete, latest, read_info, staged
from shardadopt.checkpoint.resume import load, save
from shardadopt.checkpoint.rng import load_rng_state, save_rng_state
from shardadopt.checkpoint.sharding import is_sharded, layout, rank_local
from shardadopt.checkpoint.state import check_compatible, load_sharded_state, save_sharded_state
from shardadopt.fence import PeerFailedError

__all__ = ["save", "load", "latest", "read_info", "is_complete", "is_sharded", "rank_local", "layout", "save_full",
           "full_state_dict", "staged", "save_sharded_state", "load_sharded_state",
           "save_rng_state", "load_rng_state", "check_compatible", "CheckpointInfo", "CheckpointError",
           "IncompleteCheckpointError", "CheckpointMismatchError", "DamagedCheckpointError", "UntrustedCheckpointError",
           "PeerFailedError", "MARKER", "FORMAT"]
