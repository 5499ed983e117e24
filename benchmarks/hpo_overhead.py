"""Distributed HPO overhead: the control round per report + should_prune, Trainer trials per minute, and study
throughput with 1 vs 2 concurrent jobs.

    python benchmarks/hpo_overhead.py [--calls 1000] [--ranks 2 4] [--trials 8] [--skip-trainer]
                                      [--study-trials 16] [--study-storage URL] [--skip-study]
                                      [--skip-hooks] [--hook-steps 20]

1. Per ``report`` + ``should_prune`` on 2 and 4 gloo ranks (``DistributedTrial`` inside ``shardadopt.hpo.optimize``,
   MedianPruner, in-memory storage): the median wall time per pair on rank 0, side by side with the floor the
   FINDINGS name (one broadcast of a one-byte tensor on the same gloo group), with one bare
   all-reduce of a control round's table (world x 4 int64: the collective a round is made of, so
   ``rt/all_reduce`` is shardadopt's own share) and with the same Optuna calls in one process (what rank 0 spends
   in Optuna itself). Target: < 2 ms median. With more ranks than cores the collectives wait for the scheduler.
2. ``Trainer.hyperparameter_search`` on 2 ranks with the tiny qwen3 model: trials per minute without pruning
   (NopPruner) and with MedianPruner, same sampler seed.
3. Study throughput: ``--study-trials`` trials of a cheap objective (``STUDY_STEPS`` steps, each a sleep standing in
   for the accelerator's work, an all-reduce and a report) on one durable study (``--study-storage``: default a
   journal file; e.g. ``postgresql://postgres@127.0.0.1:5432/test``), run by one 2-rank job, then split between
   two concurrent 2-rank jobs attached to the same study; trials/min over the whole study (median of
   ``STUDY_REPEATS`` fresh studies). Ideal scaling is 2x; the gap is storage contention and shared CPU cores.

4. Hang detection's per-step cost (``--skip-hooks`` to leave it out): while a fence watches for hangs every module
   forward call runs a global forward pre-hook that counts progress (``shardadopt.fence``). One process, a Qwen3
   causal LM per size in ``HOOK_MODELS`` (the tests' tiny one, and one whose step takes tens of ms on a CPU core),
   training steps (forward, backward, AdamW step) with and without the fence's progress hooks, interleaved step by
   step in the same run: median step time of each and the median of the per-pair ratios, with the module calls per
   step; and, robust to a loaded machine, the hook's cost per module call (fastest of interleaved loops over an
   ``nn.Identity``) times the calls per step over the plain step time. Target: ratio < 1.02.

Ranks share the machine's cores with everything else running: compare numbers from one run only.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

STEP_VALUE_SEED = 7
STUDY_STEPS = 5
STUDY_STEP_SECONDS = 0.02
STUDY_REPEATS = 3
# name -> (hidden size, layers, intermediate size, batch, sequence length) of the hook-overhead models
HOOK_MODELS = {"tiny (tests)": (64, 2, 128, 2, 16), "small": (256, 4, 704, 4, 128)}


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
        timings["pair"] = _report_prune_ms(trial, calls)
        return 0.0

    study = optuna.create_study(pruner=optuna.pruners.MedianPruner()) if rank == 0 else None
    optimize(study, objective, n_trials=1)

    group = control_group(control_timeout())
    flag = torch.zeros(1, dtype=torch.uint8)
    table = torch.zeros(dist.get_world_size(), 4, dtype=torch.int64)  # the size of one control round's message
    # the control group is a gloo backend of its own, used through its methods as the control rounds use it
    floors = {"broadcast": lambda: group.broadcast(flag, 0).wait(),
              "all_reduce": lambda: group.allreduce([table]).wait()}
    result = {"pair": timings["pair"]}
    for name, collective in floors.items():
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            collective()
            samples.append(time.perf_counter() - start)
        result[name] = statistics.median(samples) * 1e3
    return result


def _report_prune_ms(trial, calls: int) -> float:
    """Median milliseconds of one report + should_prune round trip on ``trial``."""
    pairs = []
    for step in range(calls):
        start = time.perf_counter()
        trial.report(1.0 / (step + 1), step)
        trial.should_prune()
        pairs.append(time.perf_counter() - start)
    return statistics.median(pairs) * 1e3


def _optuna_alone(calls: int) -> float:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner())
    return _report_prune_ms(study.ask(), calls)


def _trainer_trials(model_path: str, out: str, n_trials: int, prune: bool) -> float:
    """On every rank: one Trainer search; returns trials per minute."""
    import optuna
    from transformers import AutoModelForCausalLM, PrinterCallback, Trainer, TrainingArguments

    import shardadopt

    shardadopt.enable()
    optuna.logging.set_verbosity(optuna.logging.ERROR)

    from shardadopt.testing.models import token_dataset

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=8, eval_strategy="steps",
                             eval_steps=2, logging_steps=100, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model_init=lambda trial=None: AutoModelForCausalLM.from_pretrained(model_path), args=args,
                      train_dataset=token_dataset(64), eval_dataset=token_dataset(8, 1000))
    trainer.remove_callback(PrinterCallback)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2) if prune else optuna.pruners.NopPruner()
    start = time.perf_counter()
    trainer.hyperparameter_search(
        backend="optuna", n_trials=n_trials, direction="minimize", pruner=pruner,
        sampler=optuna.samplers.RandomSampler(seed=STEP_VALUE_SEED),
        hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-6, 1e-1, log=True)})
    return n_trials / (time.perf_counter() - start) * 60


def _study_job(storage: str, study_name: str, n_trials: int, seed: int) -> None:
    """On every rank of one job: attach to the shared study and run ``n_trials`` cheap trials."""
    import warnings

    import optuna
    import torch
    import torch.distributed as dist

    from shardadopt.hpo import ConcurrencyWarning, StudySpec, optimize
    from shardadopt.hpo.storage import default_sampler

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.simplefilter("ignore", ConcurrencyWarning)

    def objective(trial):
        x = trial.suggest_float("x", -1.0, 1.0)
        value = 0.0
        for step in range(STUDY_STEPS):
            time.sleep(STUDY_STEP_SECONDS)  # the accelerator's work on this step
            t = torch.tensor([(x - 0.2) ** 2 + 0.01 * step])
            dist.all_reduce(t)
            value = t.item() / dist.get_world_size()
            trial.report(value, step)
        return value

    spec = StudySpec(storage=storage, study_name=study_name, direction="minimize", sampler=default_sampler(seed=seed))
    optimize(spec, objective, n_trials=n_trials)


def _study_throughput(pools: list, storage: str, n_trials: int) -> float:
    """Trials/min of one fresh study whose ``n_trials`` are split between ``pools`` running at once."""
    import threading
    import uuid

    name = f"throughput-{uuid.uuid4().hex[:8]}"
    errors: list = []

    def run(pool, share, seed):
        try:
            pool.run(_study_job, storage, name, share, seed, timeout=600)
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    shares = [n_trials // len(pools) + (i < n_trials % len(pools)) for i in range(len(pools))]
    threads = [threading.Thread(target=run, args=(pool, share, seed))
               for seed, (pool, share) in enumerate(zip(pools, shares))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    import optuna

    from shardadopt.hpo.storage import resolve_storage

    optuna.delete_study(study_name=name, storage=resolve_storage(storage, heartbeat_interval=None))
    if errors:
        raise errors[0]
    return n_trials / elapsed * 60


def hook_overhead(steps: int) -> dict[str, dict[str, float]]:
    """Per ``HOOK_MODELS`` entry: median step ms without and with the fence's progress hooks (interleaved), the
    median per-pair ratio, and module forward calls per step."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from shardadopt.fence import progress_hooks

    torch.set_num_threads(1)
    per_call_us = hook_cost_per_call()
    out = {}
    for name, (hidden, layers, intermediate, batch, length) in HOOK_MODELS.items():
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=hidden // 4, max_position_embeddings=length)
        model = Qwen3ForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 512, (batch, length))

        def step(model=model, optimizer=optimizer, ids=ids) -> float:
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return time.perf_counter() - start

        step()  # warm-up
        times: dict[bool, list[float]] = {False: [], True: []}
        calls = 0
        for i in range(steps):
            for hooked in ((False, True) if i % 2 else (True, False)):  # alternate which goes first
                if hooked:
                    progress_hooks.add_hooks()  # what an armed fence with a finite hang timeout installs
                    before = progress_hooks.count()
                try:
                    times[hooked].append(step())
                finally:
                    if hooked:
                        calls = progress_hooks.count() - before
                        progress_hooks.remove_hooks()
        ratios = [h / p for p, h in zip(times[False], times[True])]
        plain = statistics.median(times[False]) * 1e3
        out[name] = {"plain ms": plain, "hooked ms": statistics.median(times[True]) * 1e3,
                     "ratio": statistics.median(ratios), "calls": calls,
                     "estimate": 1 + calls * per_call_us * 1e-3 / plain}
    return out


def hook_cost_per_call(calls: int = 20000, repeats: int = 7) -> float:
    """Microseconds the progress hook adds to one module call (``nn.Identity``), the fastest of ``repeats``
    interleaved loops each way: a load-robust figure to multiply by the calls per step."""
    import torch

    from shardadopt.fence import progress_hooks

    module, x = torch.nn.Identity(), torch.zeros(1)
    best = {False: math.inf, True: math.inf}
    for _ in range(repeats):
        for hooked in (False, True):
            if hooked:
                progress_hooks.add_hooks()
            try:
                start = time.perf_counter()
                for _ in range(calls):
                    module(x)
                best[hooked] = min(best[hooked], (time.perf_counter() - start) / calls)
            finally:
                if hooked:
                    progress_hooks.remove_hooks()
    return (best[True] - best[False]) * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--skip-trainer", action="store_true")
    parser.add_argument("--study-trials", type=int, default=16)
    parser.add_argument("--study-storage", default=None, help="storage URL (default: a journal file in a temp dir)")
    parser.add_argument("--skip-study", action="store_true")
    parser.add_argument("--skip-hooks", action="store_true")
    parser.add_argument("--hook-steps", type=int, default=20)
    options = parser.parse_args(argv)

    if not options.skip_hooks:
        print(f"hang detection's progress hooks, one process, median of {options.hook_steps} interleaved steps; "
              "target ratio < 1.02")
        rows = hook_overhead(options.hook_steps)
        print(f"  hook cost per module call {hook_cost_per_call():.2f} us (fastest of 7 loops each way)")
        print(f"  {'model':<14} {'calls/step':>10} {'plain ms':>9} {'hooked ms':>10} {'ratio':>7} "
              f"{'calls x cost':>13}")
        for name, row in rows.items():
            print(f"  {name:<14} {row['calls']:>10} {row['plain ms']:>9.2f} {row['hooked ms']:>10.2f} "
                  f"{row['ratio']:>7.3f} {row['estimate']:>13.4f}", flush=True)

    from shardadopt.testing import RankPool, tiny_checkpoints

    quiet = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    alone = _optuna_alone(options.calls)
    print(f"report+should_prune, median of {options.calls} (ms); target < 2 ms")
    print(f"  {'ranks':>5} {'round trip':>11} {'1-byte broadcast':>17} {'bare all_reduce':>16} {'optuna alone':>13} "
          f"{'rt/broadcast':>13} {'rt/all_reduce':>14}")
    for nproc in options.ranks:
        with RankPool(nproc, env=quiet) as pool:
            result = pool.run(_round_trips, options.calls, timeout=600)[0]
        print(f"  {nproc:>5} {result['pair']:>11.3f} {result['broadcast']:>17.3f} {result['all_reduce']:>16.3f} "
              f"{alone:>13.3f} {result['pair'] / result['broadcast']:>13.2f} "
              f"{result['pair'] / result['all_reduce']:>14.2f}", flush=True)
    if not options.skip_study:
        with tempfile.TemporaryDirectory() as root:
            storage = options.study_storage or f"journal://{root}/study.log"
            print(f"study throughput, {options.study_trials} trials x {STUDY_STEPS} steps "
                  f"({STUDY_STEP_SECONDS * 1e3:.0f} ms work each), 2 ranks per job, {storage.split(':', 1)[0]}; "
                  f"median of {STUDY_REPEATS}")
            with RankPool(2, env=quiet) as first, RankPool(2, env=quiet) as second:
                _study_throughput([first, second], storage, 4)  # warm-up: imports and control groups, untimed
                rates = {jobs: statistics.median(_study_throughput(pools, storage, options.study_trials)
                                                 for _ in range(STUDY_REPEATS))
                         for jobs, pools in ((1, [first]), (2, [first, second]))}
            for jobs, rate in rates.items():
                print(f"  {jobs} job(s) {rate:8.1f} trials/min", flush=True)
            print(f"  ratio 2 jobs / 1 job {rates[2] / rates[1]:.2f} (ideal 2.00)", flush=True)
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
