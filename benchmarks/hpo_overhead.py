"""Distributed HPO overhead: the control round per report + should_prune, and Trainer trials per minute.

    python benchmarks/hpo_overhead.py [--calls 1000] [--ranks 2 4] [--trials 8] [--skip-trainer]

1. Per ``report`` + ``should_prune`` on 2 and 4 gloo ranks (``DistributedTrial`` inside ``shardadopt.hpo.optimize``,
   MedianPruner, in-memory storage): the median wall time per pair on rank 0, side by side with the floor the
   FINDINGS name (one ``dist.broadcast`` of a one-byte tensor on the same gloo group) and with the same Optuna calls
   in one process (what rank 0 spends in Optuna itself). Target: < 2 ms median.
2. ``Trainer.hyperparameter_search`` on 2 ranks with the tiny qwen3 model: trials per minute without pruning
   (NopPruner) and with MedianPruner, same sampler seed.

Ranks share the machine's cores with everything else running: compare numbers from one run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

STEP_VALUE_SEED = 7


def _round_trips(calls: int) -> dict:
    """On every rank: time ``calls`` report+should_prune pairs, and as many one-byte broadcasts."""
    import optuna
    import torch
    import torch.distributed as dist

    from shardadopt.hpo import optimize
    from shardadopt.hpo.channel import control_group, control_timeout

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rank = dist.get_rank()
    timings: dict = {}

    def objective(trial):
        pairs = []
        for step in range(calls):
            start = time.perf_counter()
            trial.report(1.0 / (step + 1), step)
            trial.should_prune()
            pairs.append(time.perf_counter() - start)
        timings["pair"] = pairs
        return 0.0

    study = optuna.create_study(pruner=optuna.pruners.MedianPruner()) if rank == 0 else None
    optimize(study, objective, n_trials=1)

    group = control_group(control_timeout())
    flag = torch.zeros(1, dtype=torch.uint8)
    broadcasts = []
    for _ in range(calls):
        start = time.perf_counter()
        dist.broadcast(flag, src=0, group=group)
        broadcasts.append(time.perf_counter() - start)
    return {"pair": statistics.median(timings["pair"]) * 1e3, "broadcast": statistics.median(broadcasts) * 1e3}


def _optuna_alone(calls: int) -> float:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner())
    trial = study.ask()
    pairs = []
    for step in range(calls):
        start = time.perf_counter()
        trial.report(1.0 / (step + 1), step)
        trial.should_prune()
        pairs.append(time.perf_counter() - start)
    return statistics.median(pairs) * 1e3


def _trainer_trials(model_path: str, out: str, n_trials: int, prune: bool) -> float:
    """On every rank: one Trainer search; returns trials per minute."""
    import optuna
    import torch
    from torch.utils.data import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback, Trainer, TrainingArguments

    import shardadopt

    shardadopt.enable()
    optuna.logging.set_verbosity(optuna.logging.ERROR)

    class Tokens(Dataset):
        def __init__(self, n, offset=0):
            self.n, self.offset = n, offset

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            ids = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(i + self.offset))
            return {"input_ids": ids, "labels": ids.clone()}

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=8, eval_strategy="steps",
                             eval_steps=2, logging_steps=100, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model_init=lambda trial=None: AutoModelForCausalLM.from_pretrained(model_path), args=args,
                      train_dataset=Tokens(64), eval_dataset=Tokens(8, 1000))
    trainer.remove_callback(PrinterCallback)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2) if prune else optuna.pruners.NopPruner()
    start = time.perf_counter()
    trainer.hyperparameter_search(
        backend="optuna", n_trials=n_trials, direction="minimize", pruner=pruner,
        sampler=optuna.samplers.RandomSampler(seed=STEP_VALUE_SEED),
        hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-6, 1e-1, log=True)})
    return n_trials / (time.perf_counter() - start) * 60


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--skip-trainer", action="store_true")
    options = parser.parse_args(argv)

    from shardadopt.testing import RankPool, tiny_checkpoints

    quiet = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    alone = _optuna_alone(options.calls)
    print(f"report+should_prune, median of {options.calls} (ms); target < 2 ms")
    print(f"  {'ranks':>5} {'round trip':>11} {'1-byte broadcast':>17} {'optuna alone':>13} {'ratio rt/broadcast':>19}")
    for nproc in options.ranks:
        with RankPool(nproc, env=quiet) as pool:
            result = pool.run(_round_trips, options.calls, timeout=600)[0]
        print(f"  {nproc:>5} {result['pair']:>11.3f} {result['broadcast']:>17.3f} {alone:>13.3f} "
              f"{result['pair'] / result['broadcast']:>19.2f}", flush=True)
    if options.skip_trainer:
        return
    with tempfile.TemporaryDirectory() as root:
        models = tiny_checkpoints(os.path.join(root, "models"), ["qwen3"])
        print(f"Trainer.hyperparameter_search, 2 ranks, tiny qwen3, {options.trials} trials x 8 steps, eval every 2")
        with RankPool(2, env=quiet) as pool:
            for prune in (False, True):
                rate = pool.run(_trainer_trials, models["qwen3"], os.path.join(root, "out"), options.trials,
                                prune, timeout=900)[0]
                print(f"  {'MedianPruner' if prune else 'no pruning':<13} {rate:7.1f} trials/min", flush=True)


if __name__ == "__main__":
    sys.exit(main())
