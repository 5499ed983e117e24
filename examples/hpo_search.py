"""Trainer.hyperparameter_search(backend="optuna") over a model sharded while loading, shared by several jobs.

    torchrun --standalone --nproc-per-node 2 examples/hpo_search.py --n-trials 2

Every trial runs on every rank of the job: ``model_init`` loads the model FSDP-sharded over all of them, and
shardadopt keeps the ranks together through pruning, errors and preemption. The study lives in durable storage
(``--storage``: a PostgreSQL URL or ``journal:///path``; by default a journal file under ``--output-dir``), so
jobs started with the same ``--study`` share it as workers. Trials checkpoint as they train; when a job dies,
``shardadopt hpo requeue`` marks its trial ``preempted`` and enqueues one retry, which the next job to ask for a
trial runs from the dead trial's last complete checkpoint. ``shardadopt hpo status`` / ``best`` report on it.

``--kill-after-checkpoint`` simulates a job lost mid-trial: rank 0 SIGKILLs itself right after its first
checkpoint (torchrun then stops the other ranks).

Before promoting a winner: ``shardadopt hpo reseed --top 3`` enqueues the best configurations again with fresh
seeds into the companion study ``hpo-search-reseed``, which this same script runs (``--study hpo-search-reseed``:
each re-run trains with ``TrainingArguments.seed`` set to its seed); ``best`` then ranks by the mean over seeds.
The first ``--unpruned-trials`` trials run to the end whatever the pruner says, so ``shardadopt hpo check-pruning``
can tell whether the first rung predicts the final value; ``shardadopt hpo plot`` draws the study. A new search
space (``--space v2``) gets a new study, warm-started with the best configurations of the old one
(``--warm-start-from hpo-search``).
"""

from __future__ import annotations

import argparse
import os
import signal

import shardadopt

shardadopt.enable()  # first, before transformers is used

import optuna  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint path or hub id (default: a generated tiny Qwen3)")
    parser.add_argument("--output-dir", default="runs/hpo-search", help="trial checkpoints (and the journal)")
    parser.add_argument("--storage", help="postgresql://... or journal:///path (default: a journal in --output-dir)")
    parser.add_argument("--study", default="hpo-search", help="study name; jobs with the same one share it")
    parser.add_argument("--n-trials", type=int, default=2, help="trials this job runs")
    parser.add_argument("--max-steps", type=int, default=3, help="optimizer steps per trial")
    parser.add_argument("--kill-after-checkpoint", action="store_true",
                        help="simulate a lost job: SIGKILL rank 0 after the first checkpoint of its first trial")
    parser.add_argument("--space", choices=sorted(SPACES), default="v1", help="search-space version")
    parser.add_argument("--unpruned-trials", type=int, default=4,
                        help="the study's first N sampled trials run to the end (for shardadopt hpo check-pruning)")
    parser.add_argument("--warm-start-from", help="a study of an older space version: enqueue its best 3 first")
    return parser.parse_args()


def default_model() -> str:
    """A tiny random checkpoint, written once (atomically, so every rank may call this)."""
    from shardadopt.testing import tiny_checkpoints

    return tiny_checkpoints("runs/tiny-models", ["qwen3"])["qwen3"]


class TokenDataset(torch.utils.data.Dataset):
    """Stand-in data: random token sequences, the same on every rank (use your tokenized dataset)."""

    def __init__(self, size: int, vocab_size: int, seed: int, seq_len: int = 32) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(0, vocab_size, (seq_len,), generator=generator) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


class KillAfterFirstCheckpoint(TrainerCallback):
    """The simulated failure: the job disappears without any chance to clean up (OOM killer, lost node)."""

    def on_save(self, args, state, control, **kwargs):
        if int(os.environ.get("RANK", "0")) == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def hp_space(trial: optuna.Trial) -> dict:
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-5, 1e-2, log=True),
            "weight_decay": trial.suggest_float("weight_decay", 0.0, 0.1)}


def hp_space_v2(trial: optuna.Trial) -> dict:
    """Version 2: a narrower learning rate, weight decay fixed, gradient clipping tuned."""
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True),
            "max_grad_norm": trial.suggest_float("max_grad_norm", 0.5, 2.0)}


SPACES = {"v1": hp_space, "v2": hp_space_v2}


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    model_path = args.model or default_model()

    def model_init(trial=None):
        # Called by Trainer for every trial: each trial trains a fresh model, sharded while loading.
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                    distributed_config=DistributedConfig(fsdp_size=world))

    training_args = TrainingArguments(
        output_dir=args.output_dir,  # each trial checkpoints in a directory of its own under it
        max_steps=args.max_steps,
        per_device_train_batch_size=2,
        eval_strategy="steps",
        eval_steps=1,  # each evaluation is reported to the pruner
        save_strategy="steps",
        save_steps=1,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),  # torchrun's processes join one gloo job on CPU-only machines
    )
    vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
    trainer = Trainer(model_init=model_init, args=training_args,
                      train_dataset=TokenDataset(64, vocab_size, seed=0),
                      eval_dataset=TokenDataset(8, vocab_size, seed=1),
                      callbacks=[KillAfterFirstCheckpoint()] if args.kill_after_checkpoint else [])

    best = trainer.hyperparameter_search(
        backend="optuna", hp_space=SPACES[args.space], n_trials=args.n_trials, direction="minimize",
        # intermediate values are at training examples seen (4 per step on 2 ranks): none pruned before step 2
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=8),
        storage=args.storage, study_name=args.study,  # shared by every job started with these
        unpruned_trials=args.unpruned_trials,  # the pruning check's fair sample
        warm_start_from=args.warm_start_from, warm_start_top=3,  # idempotent: every job may pass it
    )
    if trainer.is_world_process_zero():
        print(f"best so far: trial {best.run_id} eval_loss {best.objective:.4f} {best.hyperparameters}")


if __name__ == "__main__":
    main()
