"""One rank raising inside a checkpoint save: every rank raises at once, nothing is published, the last complete
checkpoint resumes exactly.

On 2 gloo ranks with an FSDP-sharded tiny qwen3: a complete checkpoint at step 1, one more training step (the
reference loss), then a save at step 2 in which one rank fails, in user shape: the optimizer's ``state_dict`` (a
pre-hook raising on rank 1, while rank 0 is in DCP's collectives), ``os.fsync`` raising on rank 1 inside DCP's
writes (DCP gathers it into its ``CheckpointException``, a ``BaseException``, on every rank: the ranks must raise
the fence's errors instead), a scheduler-like object whose ``state_dict`` raises on rank 0 (while rank 1 waits at
the publication barrier), ``save_full`` into a path that is a file on rank 0 (while rank 1 sends its shards),
``Accelerator.save_state`` with a registered object whose ``state_dict`` raises on rank 1 (automatic naming with
``total_limit=1``, after one complete save: that one must survive the failed save), Trainer's ``save_total_limit``
rotation raising on rank 0 after checkpoint-2 was published (while rank 1 waits for it). Each asserts: every rank
raised within ``BOUND`` seconds (the process group timeout is 30 minutes), the failing rank its own error and the
other ``PeerFailedError`` naming it; no new checkpoint directory; after ``shardadopt.fence.rebuild_world()`` a fresh
model loading the latest complete checkpoint trains the next step exactly as the uninterrupted run did.
"""

from __future__ import annotations

import os
import time

import pytest

from shardadopt.selftest import checkpoint as scenario

pytestmark = pytest.mark.multiproc

BOUND = 30.0
FSDP = {"fsdp_size": 2}
CASES = [("optimizer_state_dict", 1), ("dcp_write", 1), ("scheduler_state_dict", 0), ("save_full", 0),
         ("accelerate_custom", 1), ("trainer_rotation", 0)]


class InjectedFault(RuntimeError):
    pass


def _save_with_fault(path: str, root: str, case: str, failing: int) -> dict:
    import torch
    import torch.distributed as dist

    import shardadopt
    from shardadopt import checkpoint, fence

    shardadopt.enable()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, optimizer, scheduler = scenario.build(path, FSDP)
    scenario.train_steps(model, optimizer, scheduler, FSDP, 1)
    checkpoint.save(f"{root}/step-1", model, optimizer, scheduler, step=1)
    expected = scenario.train_steps(model, optimizer, scheduler, FSDP, 1)
    marks: dict = {}

    def fail(where: str):
        marks["fault_at"] = time.time()
        raise InjectedFault(f"injected on rank {rank} in {where}")

    class Stateful:
        armed = True

        def state_dict(self):
            if rank == failing and self.armed:
                fail("a state_dict")
            return {}

        def load_state_dict(self, state):
            pass

    error = None
    try:
        if case == "optimizer_state_dict":
            optimizer.register_state_dict_pre_hook(lambda opt: fail("an optimizer state_dict pre-hook")
                                                   if rank == failing else None)
            checkpoint.save(f"{root}/step-2", model, optimizer, scheduler, step=2)
        elif case == "dcp_write":  # DCP gathers the error and raises its CheckpointException on every rank
            fsync = os.fsync
            if rank == failing:
                os.fsync = lambda fd: fail("os.fsync in DCP's writes")  # a filesystem that fails
            try:
                checkpoint.save(f"{root}/step-2", model, optimizer, scheduler, step=2)
            finally:
                os.fsync = fsync
        elif case == "scheduler_state_dict":
            checkpoint.save(f"{root}/step-2", model, optimizer, [scheduler, Stateful()], step=2)
        elif case == "save_full":
            blocker = f"{root}/not-a-directory"
            if rank == 0:
                open(blocker, "w").close()
            marks["fault_at"] = time.time()  # rank 0 fails creating the staging directory, at once
            checkpoint.save_full(model, f"{blocker}/final")
        elif case == "trainer_rotation":
            from transformers import Trainer, TrainingArguments, trainer_utils

            from shardadopt.testing.models import token_dataset

            rotate = trainer_utils.rotate_checkpoints

            def rotate_or_fail(output_dir, **kwargs):  # rank 0 alone rotates: it fails removing checkpoint-1
                if len(os.listdir(output_dir)) > 1:
                    fail("rotate_checkpoints")
                rotate(output_dir, **kwargs)

            trainer_utils.rotate_checkpoints = rotate_or_fail
            try:
                Trainer(model=model, args=TrainingArguments(
                    output_dir=f"{root}/.trainer", max_steps=2, save_steps=1, save_total_limit=1,
                    per_device_train_batch_size=2, use_cpu=True, report_to=[], disable_tqdm=True),
                    train_dataset=token_dataset(16)).train()
            finally:
                trainer_utils.rotate_checkpoints = rotate
        else:
            from accelerate.utils import ProjectConfiguration

            from shardadopt.testing.accelerator import fresh_accelerator

            accelerator = fresh_accelerator(cpu=True, project_config=ProjectConfiguration(
                project_dir=f"{root}/.accelerate", automatic_checkpoint_naming=True, total_limit=1))
            prepared, prepared_optimizer = accelerator.prepare(model, optimizer)
            stateful = Stateful()
            accelerator.register_for_checkpointing(stateful)
            stateful.armed = False
            accelerator.save_state()  # checkpoint_0, complete
            stateful.armed = True
            accelerator.save_state()  # checkpoint_1 fails; total_limit=1 must not have taken checkpoint_0 first
    except Exception as exc:  # noqa: BLE001
        error = {"type": type(exc).__name__, "message": str(exc), "at": time.time(),
                 "rank": getattr(exc, "rank", None)}
    fence.rebuild_world()  # the fence broke the process groups; a new job would start here
    published = sorted(name for name in os.listdir(root) if not name.startswith("."))
    accelerate_root = f"{root}/.accelerate/checkpoints"
    accelerate_kept = sorted(os.listdir(accelerate_root)) if os.path.isdir(accelerate_root) else None
    trainer_kept = sorted(n for n in os.listdir(f"{root}/.trainer") if checkpoint.is_complete(f"{root}/.trainer/{n}")
                          ) if os.path.isdir(f"{root}/.trainer") else None
    latest = checkpoint.latest(root)
    torch.manual_seed(1)  # the checkpoint's RNG state must win
    model, optimizer, scheduler = scenario.build(path, FSDP)
    checkpoint.load(latest, model, optimizer, scheduler)
    resumed = scenario.train_steps(model, optimizer, scheduler, FSDP, 1)
    return {"error": error, "fault_at": marks.get("fault_at"), "published": published,
            "accelerate_kept": accelerate_kept, "trainer_kept": trainer_kept,
            "latest": os.path.basename(latest), "expected": expected, "resumed": resumed}


@pytest.mark.parametrize("case,failing", CASES)
def test_one_rank_raising_in_a_save_makes_every_rank_raise(pool2, tiny_models, tmp_path, case, failing):
    results = pool2.run(_save_with_fault, tiny_models["qwen3"], str(tmp_path), case, failing, timeout=300)
    fault_at = results[failing]["fault_at"]
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None, f"rank {rank} did not raise"
        if rank == failing:
            assert error["type"] in {"InjectedFault", "NotADirectoryError", "FileExistsError"}, error
        else:
            assert error["type"] == "PeerFailedError" and error["rank"] == failing, error
            if case != "save_full":
                assert f"injected on rank {failing}" in error["message"], error
        assert 0 <= error["at"] - fault_at < BOUND, f"rank {rank} raised {error['at'] - fault_at:.1f}s after"
        assert "step-2" not in result["published"] and "final" not in result["published"], result["published"]
        assert result["latest"] == "step-1"
        if case == "accelerate_custom":
            assert [n for n in result["accelerate_kept"] if not n.startswith(".")] == ["checkpoint_0"], result
        if case == "trainer_rotation":  # the fault came after publication: both complete checkpoints remain
            assert result["trainer_kept"] == ["checkpoint-1", "checkpoint-2"], result
        assert result["resumed"] == result["expected"], "the last complete checkpoint resumes exactly"
