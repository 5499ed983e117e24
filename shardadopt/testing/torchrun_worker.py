"""A training loop as users run it under ``torchrun --max-restarts``; rank 1 (rank 0 for ``publish``) SIGKILLs itself
at each point of ``--kill``, one kill per attempt. ``--loop accelerate``: save_state every step, resume from
``shardadopt.checkpoint.latest``; ``--loop trainer``: ``Trainer`` saving every step,
``train(resume_from_checkpoint=True)`` when a checkpoint exists (backward kills only).

    torchrun --nproc-per-node 2 --max-restarts 1 shardadopt/testing/torchrun_worker.py --model M --layout fsdp \
        --work W --kill backward

``--kill``: ``none``, or kill points separated by commas, the first for the first attempt, the next for the attempt
after it, ...; each ``POINT`` or ``POINT@STEP`` (default step ``--kill-step``; ``first``: the first step after this
attempt's resume). Points: ``forward`` (entering the first decoder layer's forward), ``backward`` (inside the
backward, from a gradient hook on the first decoder layer's output), ``optimizer`` (entering ``optimizer.step()``),
``save`` (inside the step's checkpoint save, at DCP's first ``os.fsync``), ``publish`` (rank 0, inside the save's
publication: the completion marker written in the staging directory, not yet renamed into place). Rank 0 appends
one JSON line per step to ``W/steps.jsonl`` (the attempt's resume step, the loss, the time, whether the default
group's store held a key an earlier attempt wrote) and saves the final full parameters to ``W/final.pt``; the dying
rank appends a JSON line to ``W/killed`` (the time, the point, the step, the attempt's resume step) right before it
kills itself. Run by
``tests/checkpoint/test_torchrun_restart.py`` and ``benchmarks/torchrun_restart.py``; only as a script (it enables
shardadopt at import, as a user's script does).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time
from unittest import mock

import shardadopt

shardadopt.enable()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from shardadopt import upstream  # noqa: E402
from shardadopt.testing import full  # noqa: E402
from shardadopt.testing.layouts import distributed_sizes  # noqa: E402
from shardadopt.testing.models import token_dataset  # noqa: E402

STALE_KEY = "torchrun-worker/written-by-an-attempt"
POINTS = ("forward", "backward", "optimizer", "save", "publish")


class Progress:
    """Optimizer steps done; registered for checkpointing, so save_state/load_state carry it."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def die(work: str, **where) -> None:
    """Record the kill (one JSON line: the time and ``where``), then SIGKILL this process."""
    with open(os.path.join(work, "killed"), "a") as file:
        file.write(json.dumps({"time": time.time(), **where}) + "\n")
    os.kill(os.getpid(), signal.SIGKILL)


def kill_points(kill: str, default_step: int) -> list[tuple[str, int | None]]:
    """``--kill`` parsed: (point, step) per attempt, step None for the first step after the resume."""
    if kill == "none":
        return []
    points = []
    for item in kill.split(","):
        point, _, step = item.partition("@")
        if point not in POINTS or (step and step != "first" and not step.isdigit()):
            raise SystemExit(f"--kill {kill!r}: {item!r} is not POINT[@STEP|@first], POINT one of {POINTS}")
        points.append((point, None if step == "first" else int(step) if step else default_step))
    return points


class Run:
    """What both loops share: the arguments, the kill, the step records, the final parameters."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        killed = os.path.join(args.work, "killed")
        done = len(open(killed).read().splitlines()) if os.path.exists(killed) else 0  # kills of earlier attempts
        points = kill_points(args.kill, args.kill_step)
        self.attempt = done
        self.point, self.kill_step = points[done] if done < len(points) else (None, None)
        self.stale = False
        self.resumed_at = 0

    def load(self):
        """The model sharded while loading; then whether this attempt's store holds a key an earlier one wrote."""
        sizes, _ = distributed_sizes(self.args.layout, int(os.environ["WORLD_SIZE"]))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(self.args.model, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(**sizes))
        if dist.get_rank() == 0:
            store = upstream.default_store()
            self.stale = store.check([STALE_KEY])
            store.set(STALE_KEY, "1")
        return model

    def killing(self, point: str, step: int) -> bool:
        """Whether this rank dies at ``point`` of ``step`` (the step being taken, from 1)."""
        at = self.kill_step if self.kill_step is not None else self.resumed_at + 1
        return self.point == point and step == at and dist.get_rank() == (0 if point == "publish" else 1)

    def die(self, step: int) -> None:
        die(self.args.work, point=self.point, step=step, resumed_at=self.resumed_at)

    def arm(self, model, optimizer, current_step) -> None:
        """Rank 1 dies at the forward, backward or optimizer step of its step (``current_step()``: the steps done
        so far)."""
        def forward(module, inputs):
            if self.killing("forward", current_step() + 1):
                self.die(current_step() + 1)

        def backward(module, inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if self.killing("backward", current_step() + 1) and hidden.requires_grad:
                hidden.register_hook(lambda grad: self.die(current_step() + 1))

        def step(*args, **kwargs):
            if self.killing("optimizer", current_step() + 1):
                self.die(current_step() + 1)

        layer = model.model.layers[0]
        layer.register_forward_pre_hook(forward)
        layer.register_forward_hook(backward)
        if optimizer is not None:  # the torch optimizer: accelerate's wrapper runs no step hooks of its own
            getattr(optimizer, "optimizer", optimizer).register_step_pre_hook(step)

    def saving(self, step: int):
        """The context a save of ``step`` runs in: the kill inside DCP's write or the publication, when it is there."""
        if self.killing("save", step):
            return mock.patch("os.fsync", side_effect=lambda fd: self.die(step))
        if self.killing("publish", step):  # its first directory fsync: the staged marker is written, not renamed
            return mock.patch("shardadopt.checkpoint.publish._fsync_dir", side_effect=lambda path: self.die(step))
        return contextlib.nullcontext()

    def record(self, step: int, loss: float, stepped: float) -> None:
        if dist.get_rank() == 0:
            with open(os.path.join(self.args.work, "steps.jsonl"), "a") as file:
                file.write(json.dumps({"attempt": self.attempt, "resumed_at": self.resumed_at, "step": step,
                                       "loss": loss, "time": stepped, "stale_key": self.stale}) + "\n")

    def finish(self, model) -> None:
        params = {name: full(p).detach().clone() for name, p in model.named_parameters()}
        if dist.get_rank() == 0:
            torch.save(params, os.path.join(self.args.work, "final.pt"))


def accelerate_loop(run: Run) -> None:
    args = run.args
    checkpoints = os.path.join(args.work, "checkpoints")
    accelerator = Accelerator(cpu=True)
    model = run.load()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, model.config.vocab_size, (16,), generator=generator) for _ in range(64)]
    loader = torch.utils.data.DataLoader(samples, batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    latest = shardadopt.checkpoint.latest(checkpoints)
    if latest is not None:
        accelerator.load_state(latest)
        loader = accelerator.skip_first_batches(loader, progress.step)
    run.resumed_at = progress.step
    run.arm(accelerator.unwrap_model(model), optimizer, lambda: progress.step)

    for batch in loader:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        progress.step += 1
        mean, stepped = accelerator.reduce(loss.detach(), "mean").item(), time.time()
        with run.saving(progress.step):
            accelerator.save_state(os.path.join(checkpoints, f"step-{progress.step}"))
        run.record(progress.step, mean, stepped)
        if progress.step == args.steps:
            break
    run.finish(accelerator.unwrap_model(model))
    accelerator.end_training()


def trainer_loop(run: Run) -> None:
    args = run.args
    output_dir = os.path.join(args.work, "trainer")
    model = run.load()
    training = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2, max_steps=args.steps,
                                 save_strategy="steps", save_steps=1, logging_steps=1, use_cpu=True, report_to=[],
                                 learning_rate=1e-2, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=token_dataset(64))

    class Record(TrainerCallback):
        def on_log(self, arguments, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                run.record(state.global_step, logs["loss"], time.time())

    trainer.add_callback(Record())
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    run.resumed_at = int(last.rsplit("-", 1)[1]) if last else 0
    run.arm(model, None, lambda: trainer.state.global_step)
    trainer.train(resume_from_checkpoint=True if last else None)
    run.finish(trainer.model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--layout", choices=["fsdp", "tp", "ep"], required=True, help="ep: an MoE --model")
    parser.add_argument("--loop", choices=["accelerate", "trainer"], default="accelerate")
    parser.add_argument("--work", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--kill", default="none", help="none, or POINT[@STEP|@first] per attempt, comma-separated")
    parser.add_argument("--kill-step", type=int, default=3)
    args = parser.parse_args()
    if args.loop == "trainer" and {point for point, _ in kill_points(args.kill, args.kill_step)} - {"backward"}:
        parser.error("--loop trainer kills in backward only")
    (trainer_loop if args.loop == "trainer" else accelerate_loop)(Run(args))


if __name__ == "__main__":
    main()
