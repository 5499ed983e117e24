"""Optuna search over a hand-written training loop of a sharded model: ``shardadopt.hpo.optimize``.

    torchrun --standalone --nproc-per-node 2 examples/custom_loop_hpo.py --n-trials 4

Every trial runs on every rank (the model is FSDP-sharded over all of them). ``optimize`` hands the objective a
``DistributedTrial`` on every rank: rank 0 talks to the study, the others get the same suggestions, and
``report_and_maybe_prune`` ends a pruned trial on all ranks at the same step, so no rank is left waiting in a
collective. The study lives in durable storage (``--storage``: a PostgreSQL URL or ``journal:///path``; by default
a journal file under ``--output-dir``), so more jobs started with the same ``--study`` work on it together. Each
trial checkpoints into a directory of its own; a retry that ``shardadopt hpo requeue`` enqueued for a preempted
trial resumes from the dead trial's last complete checkpoint.
"""

from __future__ import annotations

import argparse
import os

import shardadopt

shardadopt.enable()  # first, before transformers is used

import optuna  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

import shardadopt.checkpoint  # noqa: E402
from shardadopt.hpo import StudySpec, optimize, resume_checkpoint, trial_checkpoint_dir  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint path or hub id (default: a generated tiny Qwen3)")
    parser.add_argument("--output-dir", default="runs/custom-loop-hpo", help="trial checkpoints (and the journal)")
    parser.add_argument("--storage", help="postgresql://... or journal:///path (default: a journal in --output-dir)")
    parser.add_argument("--study", default="custom-loop", help="study name; jobs with the same one share it")
    parser.add_argument("--n-trials", type=int, default=4, help="trials this job runs")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per trial")
    return parser.parse_args()


def default_model() -> str:
    """A tiny random checkpoint, written once (atomically, so every rank may call this)."""
    from shardadopt.testing import tiny_checkpoints

    return tiny_checkpoints("runs/tiny-models", ["qwen3"])["qwen3"]


def batches(vocab_size: int, count: int, seed: int, rows: int = 4, seq_len: int = 32) -> list[torch.Tensor]:
    """Stand-in data: random token batches, the same on every rank (use your tokenized dataset)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (rows, seq_len), generator=generator) for _ in range(count)]


def main() -> None:
    args = parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_path = args.model or default_model()

    def objective(trial) -> float:
        # ``trial`` is a DistributedTrial: the same suggestions on every rank.
        lr = trial.suggest_float("lr", 1e-5, 1e-1, log=True)
        weight_decay = trial.suggest_float("weight_decay", 0.0, 0.1)

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(fsdp_size=world))
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        train = batches(model.config.vocab_size, args.steps, seed=0)
        held_out = batches(model.config.vocab_size, 1, seed=1)[0]

        # This trial's own checkpoint directory; a requeued retry starts from the dead trial's last checkpoint.
        directory = trial_checkpoint_dir(trial, args.output_dir)
        start = 0
        if (last := resume_checkpoint(trial, args.output_dir)) is not None:
            start = shardadopt.checkpoint.load(last, model, optimizer).step

        loss = float("nan")
        for step in range(start, args.steps):
            model.train()
            rows = train[step][rank::world]  # FSDP: each rank trains on its share of the global batch
            model(input_ids=rows, labels=rows).loss.backward()
            shardadopt.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            shardadopt.checkpoint.save(os.path.join(directory, f"step-{step + 1}"), model, optimizer,
                                       step=step + 1)

            model.eval()
            with torch.no_grad():
                rows = held_out[rank::world]
                loss_sum = model(input_ids=rows, labels=rows).loss.detach() * len(rows)
            dist.all_reduce(loss_sum)
            loss = loss_sum.item() / len(held_out)
            # every rank reports; rank 0's pruner decides for all, and a pruned trial ends here on every rank
            trial.report_and_maybe_prune(loss, step + 1)
        return loss

    spec = StudySpec(storage=args.storage, study_name=args.study, output_dir=args.output_dir, direction="minimize",
                     sampler=optuna.samplers.RandomSampler(seed=0),
                     pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))
    study = optimize(spec, objective, n_trials=args.n_trials)
    if rank == 0:  # optimize returns the study on rank 0 (None elsewhere)
        states = [t.state.name for t in study.trials]
        print(f"trials: {states}; best: #{study.best_trial.number} loss {study.best_value:.4f} "
              f"{study.best_params}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
