"""Two Optuna searches over a model sharded while loading, as users run them under ``torchrun --max-restarts 2``:
``shardadopt.hpo.optimize`` around the hand-written loop of ``examples/custom_loop_hpo.py`` (``shardadopt.checkpoint``
every ``SAVE_EVERY`` steps into ``trial_checkpoint_dir``, resuming from ``resume_checkpoint``), then
``Trainer.hyperparameter_search(backend="optuna")`` with a sharding ``model_init`` (a checkpoint every
``SAVE_EVERY`` steps). In each search rank 1 SIGKILLs itself once, in trial 1's step ``KILL_STEP`` backward (a
gradient hook on the first decoder layer's output: inside a training step, between two control rounds), so the job
runs three attempts.

    torchrun --nproc-per-node 2 --max-restarts 2 shardadopt/testing/torchrun_hpo_worker.py --model M --work W \
        --storage URL --study NAME

Once both searches have ended, the same ranks run each search's finished trials again, uninterrupted, in the studies
``NAME-optimize-reference`` and ``NAME-trainer-reference`` (their parameters enqueued); rank 0 writes ``W/hpo.json``:
every trial of the four studies (number, state, params, value, user attributes) and the step each trial's training
started at (``W/starts.jsonl``, appended as trials start, through every attempt). Run by
``tests/hpo/test_hpo_torchrun_restart.py``; only as a script (it enables shardadopt at import, as a user's script
does).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import shardadopt

shardadopt.enable()

import optuna  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

import shardadopt.checkpoint  # noqa: E402
from shardadopt.hpo import StudySpec, optimize, resolve_storage, resume_checkpoint, trial_checkpoint_dir  # noqa: E402
from shardadopt.testing.models import token_dataset  # noqa: E402

STEPS, SAVE_EVERY, KILL_TRIAL, KILL_STEP = 4, 2, 1, 3
TRIALS = {"optimize": 3, "trainer": 2}  # each search's n_trials


def killing(work: str, search: str) -> bool:
    """Whether rank 1 still has to die in ``search`` (once per search, over every attempt)."""
    return dist.get_rank() == 1 and not os.path.exists(os.path.join(work, f"killed-{search}"))


def kill_in_backward(model, work: str, search: str, now) -> None:
    """Rank 1 dies inside the backward of the step for which ``now()`` is true."""

    def die(grad):
        with open(os.path.join(work, f"killed-{search}"), "w") as file:
            file.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def hook(module, inputs, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if now() and hidden.requires_grad:
            hidden.register_hook(die)

    model.model.layers[0].register_forward_hook(hook)


def started(work: str, search: str, trial: int, step: int) -> None:
    if dist.get_rank() == 0:
        with open(os.path.join(work, "starts.jsonl"), "a") as file:
            file.write(json.dumps({"search": search, "trial": trial, "step": step}) + "\n")


def batches(vocab_size: int, count: int, seed: int, rows: int = 4, seq_len: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (rows, seq_len), generator=generator) for _ in range(count)]


def search_optimize(args: argparse.Namespace, study_name: str, kill: bool) -> None:
    """``examples/custom_loop_hpo.py``'s objective and search, with the kill."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.path.join(args.work, study_name)

    def objective(trial) -> float:
        lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(fsdp_size=world))
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        train = batches(model.config.vocab_size, STEPS, seed=0)
        held_out = batches(model.config.vocab_size, 1, seed=1)[0]
        directory = trial_checkpoint_dir(trial, root)
        start = 0
        if (last := resume_checkpoint(trial, root)) is not None:
            start = shardadopt.checkpoint.load(last, model, optimizer).step
        started(args.work, study_name, trial.number, start)
        step = start
        if kill and trial.number == KILL_TRIAL:
            kill_in_backward(model, args.work, "optimize", lambda: killing(args.work, "optimize")
                             and step + 1 == KILL_STEP)
        loss = float("nan")
        for step in range(start, STEPS):
            model.train()
            rows = train[step][rank::world]
            model(input_ids=rows, labels=rows).loss.backward()
            shardadopt.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if (step + 1) % SAVE_EVERY == 0:
                shardadopt.checkpoint.save(os.path.join(directory, f"step-{step + 1}"), model, optimizer,
                                           step=step + 1)
            model.eval()
            with torch.no_grad():
                rows = held_out[rank::world]
                loss_sum = model(input_ids=rows, labels=rows).loss.detach() * len(rows)
            dist.all_reduce(loss_sum)
            loss = loss_sum.item() / len(held_out)
            trial.report_and_maybe_prune(loss, step + 1)
        return loss

    spec = StudySpec(storage=args.storage, study_name=study_name, output_dir=root, direction="minimize",
                     sampler=optuna.samplers.RandomSampler(seed=0), pruner=optuna.pruners.NopPruner())
    optimize(spec, objective, n_trials=_n_trials(args, study_name, "optimize"))


def search_trainer(args: argparse.Namespace, study_name: str, kill: bool) -> None:
    """The Trainer's own search, a ``model_init`` sharding while loading, with the kill."""
    world = dist.get_world_size()

    def model_init(trial=None):
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                    distributed_config=DistributedConfig(fsdp_size=world))

    current = [-1]  # the trial being trained: hp_space sees it first

    def hp_space(trial):
        current[0] = trial.number
        return {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)}

    class Watch(TrainerCallback):
        def on_train_begin(self, arguments, state, control, model=None, **kwargs):
            started(args.work, study_name, current[0], state.global_step)
            if kill and current[0] == KILL_TRIAL:
                kill_in_backward(model, args.work, "trainer", lambda: killing(args.work, "trainer")
                                 and state.global_step + 1 == KILL_STEP)

    training = TrainingArguments(output_dir=os.path.join(args.work, study_name), per_device_train_batch_size=2,
                                 max_steps=STEPS, save_strategy="steps", save_steps=SAVE_EVERY, logging_steps=1,
                                 use_cpu=True, report_to=[], seed=0, disable_tqdm=True)
    trainer = Trainer(model_init=model_init, args=training, train_dataset=token_dataset(32),
                      eval_dataset=token_dataset(8, 1000), callbacks=[Watch()])
    trainer.hyperparameter_search(
        backend="optuna", n_trials=_n_trials(args, study_name, "trainer"), direction="minimize",
        hp_space=hp_space,
        storage=args.storage, study_name=study_name, sampler=optuna.samplers.RandomSampler(seed=0),
        pruner=optuna.pruners.NopPruner())


def _n_trials(args: argparse.Namespace, study_name: str, search: str) -> int:
    """The search's budget; a reference study runs each of the search's finished trials once (enqueued here)."""
    if not study_name.endswith("-reference"):
        return TRIALS[search]
    count = [0]
    if dist.get_rank() == 0:
        finished = [t for t in _study(args, study_name.removesuffix("-reference")).trials
                    if t.state == optuna.trial.TrialState.COMPLETE]
        reference = optuna.create_study(storage=resolve_storage(args.storage), study_name=study_name,
                                        load_if_exists=True)
        for trial in finished:
            reference.enqueue_trial(trial.params)
        count[0] = len(finished)
    dist.broadcast_object_list(count, src=0)
    return count[0]


def _study(args: argparse.Namespace, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=resolve_storage(args.storage))


def _table(args: argparse.Namespace, name: str) -> list[dict]:
    return [{"number": t.number, "state": t.state.name, "params": t.params, "value": t.value,
             "start": t.datetime_start.timestamp() if t.datetime_start else None,
             "complete": t.datetime_complete.timestamp() if t.datetime_complete else None,
             "attrs": t.user_attrs} for t in _study(args, name).trials]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--storage", required=True)
    parser.add_argument("--study", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    names = {search: f"{args.study}-{search}" for search in TRIALS}
    search_optimize(args, names["optimize"], kill=True)
    search_trainer(args, names["trainer"], kill=True)
    search_optimize(args, names["optimize"] + "-reference", kill=False)
    search_trainer(args, names["trainer"] + "-reference", kill=False)
    if dist.get_rank() == 0:
        tables = {name: _table(args, name) for search in TRIALS for name in (names[search],
                                                                            names[search] + "-reference")}
        with open(os.path.join(args.work, "hpo.json"), "w") as file:
            json.dump(tables, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
