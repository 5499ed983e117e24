"""Checkpoints written by each path (plain ``save``, ``Trainer``, ``Accelerator.save_state``), then damaged or
tampered with, and loaded again on every rank: what tests/checkpoint/test_checkpoint_safety.py and
test_checkpoint_damage.py run in their pools.

``save_all`` writes two checkpoints per path (step 1 and step 2, an FSDP-sharded tiny qwen3 on 2 ranks);
``damage`` changes one file of a copy (truncated, one bit flipped, replaced by the other step's file, removed);
``tamper`` replaces one with a pickle that runs a shell command, and reseals the marker as an attacker would (so
the checksums do not hide what loading it would do); ``load_outcome`` loads on every rank and reports what
happened there (returned, or the error's type, message and file, and how long it took).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from typing import Any

from shardadopt.selftest import checkpoint as scenario

FSDP = {"fsdp_size": 2}
PATHS = ("plain", "trainer", "accelerate")
MODES = ("truncate", "bitflip", "replace", "remove")


class Counter:
    """An object registered with ``Accelerator.register_for_checkpointing``."""

    def __init__(self) -> None:
        import torch

        self.count = torch.zeros(())

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


class Command:
    """Pickles to a call of ``os.system(command)``: what a tampered checkpoint file holds."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return (os.system, (self.command,))


def _trainer(path: str, out: str, max_steps: int):
    from transformers import Trainer, TrainingArguments

    from shardadopt.testing.accelerator import forget_accelerate_state
    from shardadopt.testing.models import token_dataset

    forget_accelerate_state()
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=max_steps, save_strategy="steps",
                             save_steps=1, use_cpu=True, report_to=[], learning_rate=1e-2, seed=7, disable_tqdm=True,
                             logging_steps=1)
    return Trainer(model=scenario.load_model(path, FSDP), args=args, train_dataset=token_dataset(16))


def _accelerate(path: str):
    from shardadopt.testing.accelerator import fresh_accelerator

    accelerator = fresh_accelerator(cpu=True)
    model, optimizer, scheduler = scenario.build(path, FSDP)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.register_for_checkpointing(Counter())
    return accelerator, model, optimizer, scheduler


def save_all(path: str, root: str) -> None:
    """Every rank: two checkpoints per path under ``root/<path>/``: ``step-1`` and ``step-2`` (the Trainer's
    ``checkpoint-1`` and ``checkpoint-2``)."""
    import torch

    import shardadopt
    from shardadopt import checkpoint

    shardadopt.enable()
    torch.manual_seed(0)
    model, optimizer, scheduler = scenario.build(path, FSDP)
    for step in (1, 2):
        scenario.train_steps(model, optimizer, scheduler, FSDP, 1)
        checkpoint.save(f"{root}/plain/step-{step}", model, optimizer, scheduler, step=step, extra={"step": step})
    _trainer(path, f"{root}/trainer", 2).train()
    accelerator, model, optimizer, scheduler = _accelerate(path)
    for step in (1, 2):
        scenario.train_steps(model, optimizer, scheduler, FSDP, 1)
        accelerator.save_state(f"{root}/accelerate/step-{step}")


def checkpoints(root: str, kind: str) -> tuple[str, str]:
    """(the checkpoint to damage, the other save of the same run) of path ``kind`` under ``root``."""
    if kind == "trainer":
        return f"{root}/trainer/checkpoint-2", f"{root}/trainer/checkpoint-1"
    return f"{root}/{kind}/step-2", f"{root}/{kind}/step-1"


def files(directory: str) -> list[str]:
    """Every file of a checkpoint, relative to it (the marker included)."""
    out = []
    for where, _, names in os.walk(directory):
        out += [os.path.relpath(os.path.join(where, n), directory) for n in names]
    return sorted(out)


def damage(directory: str, name: str, mode: str, where: float, other: str) -> bool:
    """Damage ``directory/name`` (``mode`` of :data:`MODES`, at the fraction ``where`` of its length); ``replace``
    copies the same file of checkpoint ``other`` over it. Returns whether the file's bytes changed."""
    path = os.path.join(directory, name)
    data = open(path, "rb").read()
    if mode == "remove":
        os.remove(path)
        return True
    if mode == "truncate":
        changed = data[:int(len(data) * where)]
    elif mode == "bitflip":
        at = min(int(len(data) * where), len(data) - 1)
        changed = data[:at] + bytes([data[at] ^ (1 << random.Random(at).randrange(8))]) + data[at + 1:]
    else:
        source = os.path.join(other, name)
        changed = open(source, "rb").read() if os.path.isfile(source) else os.urandom(max(1, len(data)))
    with open(path, "wb") as f:
        f.write(changed)
    return changed != data


def tamper(directory: str, name: str, command: str) -> None:
    """Replace ``directory/name`` with a pickle running ``command``, and reseal the marker with its checksum."""
    import pickle

    import torch

    from shardadopt.checkpoint import MARKER
    from shardadopt.checkpoint.integrity import FILES, digest, seal

    path = os.path.join(directory, name)
    if name.endswith(".metadata"):
        with open(path, "wb") as f:
            pickle.dump(Command(command), f)
    else:
        torch.save(Command(command), path)
    marker_path = os.path.join(directory, MARKER)
    marker = json.load(open(marker_path))
    marker[FILES][name] = {"size": os.path.getsize(path), "sha256": digest(path)}
    with open(marker_path, "w") as f:
        json.dump(seal(marker), f)


def strip_checksums(directory: str) -> None:
    """Make ``directory``'s marker what the previous release wrote: no per-file checksums, no seal."""
    from shardadopt.checkpoint import MARKER
    from shardadopt.checkpoint.integrity import FILES, SEAL

    marker_path = os.path.join(directory, MARKER)
    marker = json.load(open(marker_path))
    for key in (FILES, SEAL):
        marker.pop(key)
    with open(marker_path, "w") as f:
        json.dump(marker, f)


def copy(directory: str, into: str) -> str:
    """A fresh copy of checkpoint ``directory`` at ``into`` (replacing what is there)."""
    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(directory, into)
    return into


def load_outcome(path: str, kind: str, directory: str, trust_extra: bool = False) -> dict[str, Any]:
    """Every rank: load checkpoint ``directory`` through path ``kind`` into fresh objects; what happened here."""
    import torch

    import shardadopt
    from shardadopt import checkpoint

    shardadopt.enable()
    torch.manual_seed(0)
    start = time.monotonic()
    try:
        if kind == "plain":
            model, optimizer, scheduler = scenario.build(path, FSDP)
            start = time.monotonic()
            info = checkpoint.load(directory, model, optimizer, scheduler, trust_extra=trust_extra)
            outcome: dict[str, Any] = {"raised": None, "extra": info.extra}
        elif kind == "trainer":
            trainer = _trainer(path, os.path.dirname(directory), 2)
            start = time.monotonic()
            trainer.train(resume_from_checkpoint=directory)
            outcome = {"raised": None}
        else:
            accelerator = _accelerate(path)[0]
            start = time.monotonic()
            accelerator.load_state(directory)
            outcome = {"raised": None}
    except Exception as exc:  # noqa: BLE001  (what each rank raised is the result)
        outcome = {"raised": type(exc).__name__, "message": str(exc), "file": getattr(exc, "file", None)}
    outcome["seconds"] = time.monotonic() - start
    return outcome
