"""Do successful sharded training jobs exit 0 on every rank? Aborts per run, torchrun-launched, in a loop.

    python benchmarks/clean_exit.py --job trainer --runs 50        # 4 ranks, Trainer, HSDP (2 replicas x fsdp 2)
    python benchmarks/clean_exit.py --job accelerate --runs 50     # 2 ranks, accelerate loop, fsdp_size=2
    python benchmarks/clean_exit.py --job gloo-stress --runs 20    # 2 ranks, the race made likely (torch only)
    SHARDADOPT_DISABLE=transformers-sharded-clean-exit python benchmarks/clean_exit.py ...   # without the fix

Each run is a fresh ``torchrun --standalone`` job of a user script that does what the README tells users: two
lines (``import shardadopt; shardadopt.enable()``), a tiny checkpoint loaded with ``DistributedConfig``, a few
training steps (``Trainer.train()``, or ``prepare``/``backward``/``clip_grad_norm_``/``step``), and rank 0 printing
its result after training. Nothing calls ``destroy_process_group``: plain scripts don't. ``gloo-stress`` is torch
alone: the gloo worker threads of a group share the main thread's CPU under ``SCHED_IDLE`` and the process exits
right after its last (waited) all-reduce of parameters, so a worker often drops its last tensor after the
interpreter began finalising; the fix is armed there through ``shardadopt.lifecycle.cleanexit.arm_at_exit()``.

A run counts as *aborted* when any rank died of SIGABRT (``terminate called without an active exception``: a gloo
worker taking the GIL during finalisation; torchrun then SIGTERMs the other ranks), *failed* when torchrun exited
non-zero for another reason, *hung* when it passed ``--timeout``, *lost* when rank 0 never printed its result.
Prints one line per run and ``aborts/runs``. The race needs ranks starved of CPU at exit: run it under ``nice``
next to other work (``--parallel N`` runs N jobs side by side); a quiet big machine rarely shows it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

JOBS = {  # job -> (ranks, layout, tiny model)
    "trainer": (4, "hsdp", "llama"),
    "trainer-2d": (4, "2d", "qwen3"),
    "trainer-fsdp": (2, "fsdp", "qwen3"),
    "accelerate": (2, "fsdp", "qwen3"),
    "accelerate-hsdp": (4, "hsdp", "llama"),
    "gloo-stress": (2, None, None),
}
PATCH_ID = "transformers-sharded-clean-exit"
STEPS = 4
RESULT = "CLEAN-EXIT-RESULT"


# -- the user script (one rank) ----------------------------------------------------------------------------------

def _worker(job: str, models_dir: str) -> None:
    if job == "gloo-stress":
        _gloo_stress()
        return
    import shardadopt

    shardadopt.enable()
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from shardadopt.testing import tiny_checkpoints
    from shardadopt.testing.layouts import distributed_sizes

    ranks, layout, name = JOBS[job]
    sizes, dp = distributed_sizes(layout, world=ranks)
    path = tiny_checkpoints(models_dir, [name])[name]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(**sizes))
    losses = (_train_trainer if job.startswith("trainer") else _train_accelerate)(model, dp)
    if int(os.environ["RANK"]) == 0:
        print(f"{RESULT} losses={[f'{loss:.4f}' for loss in losses]}", flush=True)


def _train_trainer(model, dp: int) -> list[float]:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from shardadopt.selftest.trainer import PER_RANK_BATCH, TokenDataset

    with tempfile.TemporaryDirectory(prefix="clean-exit-") as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=PER_RANK_BATCH, max_steps=STEPS,
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(STEPS * PER_RANK_BATCH * dp))
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def _train_accelerate(model, dp: int) -> list[float]:
    import torch
    from accelerate import Accelerator

    from shardadopt.selftest.trainer import PER_RANK_BATCH, TokenDataset

    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    data = TokenDataset(STEPS * PER_RANK_BATCH * dp)
    loader = torch.utils.data.DataLoader(data, batch_size=PER_RANK_BATCH * dp)  # prepare() splits it by dp rank
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return losses


def _gloo_stress() -> None:
    """The race made likely: gloo's worker threads share the main thread's CPU under ``SCHED_IDLE`` (they run when
    it waits), and the process exits right after its last (waited) all-reduce of parameters. Torch alone, no model:
    the fix is armed through the plain function, as for a model sharded by hand, unless ``$SHARDADOPT_DISABLE``
    names the patch."""
    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})  # threads created from here on inherit this CPU
    import torch
    import torch.distributed as dist

    import shardadopt.lifecycle.cleanexit

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    before = set(os.listdir("/proc/self/task"))
    group = dist.new_group(list(range(dist.get_world_size())))
    for tid in set(os.listdir("/proc/self/task")) - before:  # the new group's gloo threads: run when nothing else
        os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
    if PATCH_ID not in os.environ.get("SHARDADOPT_DISABLE", "") and "all" not in os.environ.get(
            "SHARDADOPT_DISABLE", ""):
        shardadopt.lifecycle.cleanexit.arm_at_exit()
    params = [torch.nn.Parameter(torch.ones(16)) for _ in range(8)]
    for param in params:
        dist.all_reduce(param, group=group)
    if rank == 0:
        print(f"{RESULT} sum={float(sum(p.sum() for p in params))}", flush=True)


# -- the loop ------------------------------------------------------------------------------------------------------

ABORT = re.compile(r"terminate called without an active exception|SIGABRT|exitcode\s*:\s*-6\b")


def _classify(rc: int | None, output: str) -> str:
    if rc is None:
        return "hung"
    if ABORT.search(output):
        return "aborted"
    if rc != 0:
        return "failed"
    if RESULT not in output:
        return "lost"
    return "ok"


def _descendants(pid: int) -> list[int]:
    found = []
    try:
        children = [int(c) for task in os.listdir(f"/proc/{pid}/task")
                    for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
    except OSError:
        return found
    for child in children:
        found += [child, *_descendants(child)]
    return found


def _kill_job(proc: subprocess.Popen) -> None:
    """torchrun starts every rank in a session of its own: kill the ranks by pid, then torchrun."""
    for pid in [*_descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=sorted(JOBS), default="trainer")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per torchrun job")
    parser.add_argument("--models", help="tiny checkpoint directory (default: a temporary one)")
    parser.add_argument("--parallel", type=int, default=1, help="torchrun jobs at a time")
    parser.add_argument("--keep-logs", help="write each non-ok run's output here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.job, args.models)
        return

    from shardadopt.testing import tiny_checkpoints

    ranks, _, model_name = JOBS[args.job]
    models = args.models or tempfile.mkdtemp(prefix="clean-exit-models-")
    if model_name:
        tiny_checkpoints(models, [model_name])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    counts: dict[str, int] = {}
    print(f"job {args.job}: {ranks} ranks, SHARDADOPT_DISABLE={os.environ.get('SHARDADOPT_DISABLE', '')!r}",
          flush=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node",
               str(ranks), os.path.abspath(__file__), "--worker", "--job", args.job, "--models", models]

    def one_run(run: int) -> tuple[int, str, int | None, float, str]:
        start = time.monotonic()
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            output, _ = proc.communicate(timeout=args.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_job(proc)
            output, _ = proc.communicate()
            rc = None
        return run, _classify(rc, output), rc, time.monotonic() - start, output

    # Jobs side by side (--parallel) only add to the contention the race needs; each is still a whole job.
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        for run, kind, rc, seconds, output in (future.result() for future in concurrent.futures.as_completed(
                [pool.submit(one_run, run) for run in range(1, args.runs + 1)])):
            counts[kind] = counts.get(kind, 0) + 1
            print(f"run {run:3d}: {kind:8s} rc={rc} {seconds:6.1f}s", flush=True)
            if kind != "ok" and args.keep_logs:
                os.makedirs(args.keep_logs, exist_ok=True)
                with open(os.path.join(args.keep_logs, f"{args.job}-run{run}.log"), "w") as log:
                    log.write(output)
    summary = ", ".join(f"{kind} {count}" for kind, count in sorted(counts.items()))
    print(f"{args.job}: aborts {counts.get('aborted', 0)}/{args.runs} runs ({summary})", flush=True)


if __name__ == "__main__":
    main()
