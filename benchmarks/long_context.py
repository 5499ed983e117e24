"""What context parallelism buys on a load-time-sharded model: per-rank peak memory and step time against sequence
length, for cp 1, 2 and 4, measured side by side in one run.

For every sequence length and every ``cp`` the same user loop runs on ``cp`` gloo ranks: a small Llama loaded with
``from_pretrained(..., attn_implementation="sdpa", distributed_config=DistributedConfig(fsdp_size=cp))`` under
``shardadopt.enable()``, ``Accelerator(parallelism_config=ParallelismConfig(cp_size=cp))`` (none at cp 1: one
process on the whole sequence), and the loop docs/long-context.md shows: labels shifted before the split, global
position ids, every buffer split by ``accelerator.maybe_context_parallel``, AdamW. Each step trains on one sequence
(batch 1; the CP group shares it). Per rank it records the anonymous-memory peak of the step above what the rank held
before it (sampled every millisecond, as ``benchmarks/real_size.py`` does: the activations, gradients and optimizer
state the step adds), the median step time, the positions each forward saw, and the global loss of every step, which
must equal cp 1's (fp32).

    python benchmarks/long_context.py                          # 1k..16k tokens, cp 1 2 4, fresh ranks per run
    python benchmarks/long_context.py --seqs 2048 8192 32768 --cps 1 2     # pick lengths and cp sizes
    python benchmarks/long_context.py --quick                  # CI: tiny model and lengths, cp 1 and 2, a pool per
                                                               # cp; asserts the split and the losses
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from typing import Any

MIB = 2**20
# A small Llama whose activations, not its parameters, fill memory at long lengths (about 10M parameters: 40 MiB
# fp32), and a tiny one for --quick.
FULL = {"hidden": 256, "layers": 4, "intermediate": 688, "vocab": 4096, "heads": 4, "steps": 3,
        "seqs": [1024, 2048, 4096, 8192, 16384], "cps": [1, 2, 4]}
QUICK = {"hidden": 64, "layers": 2, "intermediate": 128, "vocab": 512, "heads": 4, "steps": 3,
         "seqs": [64, 256], "cps": [1, 2]}
LOSS_RTOL = 1e-4  # the global loss of a cp run against cp 1's: fp32 sums in another order


def write_llama(root: str, size: dict[str, Any], max_seq: int) -> str:
    """A randomly initialised Llama checkpoint (seed 0, fp32) of ``size`` under ``root``; its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(root, "llama-h{hidden}-l{layers}-i{intermediate}-v{vocab}".format(**size))
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"],
                             intermediate_size=size["intermediate"], num_hidden_layers=size["layers"],
                             num_attention_heads=size["heads"], num_key_value_heads=size["heads"],
                             max_position_embeddings=max_seq, tie_word_embeddings=False)
        LlamaForCausalLM(config).save_pretrained(path)
    return path


def _trim() -> None:
    """Give freed heap pages back to the system, so the next step's peak starts from what is live."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def rank_run(model_path: str, seq: int, steps: int, vocab: int) -> dict[str, Any]:
    """``steps`` training steps of one sequence of ``seq`` tokens on this rank's CP group (every rank of the pool):
    per-step time, the step's anonymous-memory peak above what the rank held before it, what the forward saw, the
    global loss."""
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from accelerate import ParallelismConfig
    from real_size import Sampler
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.testing.accelerator import fresh_accelerator

    cp = dist.get_world_size()
    shardadopt.enable()
    sampler = Sampler()
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa",
                                                     distributed_config=DistributedConfig(fsdp_size=cp))
        config = ParallelismConfig(cp_size=cp) if cp > 1 else None
        accelerator = fresh_accelerator(cpu=True, parallelism_config=config)
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False))
        seen: list[int] = []
        model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
        params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
        generator = torch.Generator().manual_seed(1234)
        model.train()
        times, peaks, losses = [], [], []
        for _ in range(steps):
            input_ids = torch.randint(0, vocab, (1, seq), generator=generator)  # the same on every rank
            labels = input_ids.clone()
            gc.collect()
            _trim()
            dist.barrier()
            before = sampler.mark()["anon"]
            start = time.perf_counter()
            shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
            position_ids = torch.arange(seq).unsqueeze(0)
            buffers = [input_ids, labels, shift_labels, position_ids]
            split = accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1, 1],
                                                       no_restore_buffers=set(buffers)) if cp > 1 else nullcontext()
            with split:
                loss = model(input_ids=input_ids, labels=labels, shift_labels=shift_labels,
                             position_ids=position_ids).loss
                accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
            peaks.append(sampler.mark()["peak_anon"] - before)
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
        return {"rank": dist.get_rank(), "times": times, "peaks": peaks, "losses": losses, "seen": seen,
                "params": params}
    except Exception as exc:  # noqa: BLE001  (reported per run; the next run goes on)
        import traceback

        return {"rank": dist.get_rank(), "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
    finally:
        sampler.close()
        shardadopt.disable()


def summarize(cp: int, seq: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """One (cp, seq) run: the worst rank's median step time and median step peak, cp's losses and what was seen."""
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"cp": cp, "seq": seq, "error": errors[0]}
    return {"cp": cp, "seq": seq, "step_s": max(statistics.median(r["times"]) for r in results),
            "peak_mib": max(statistics.median(r["peaks"]) for r in results) / MIB,
            "losses": results[0]["losses"], "seen": sorted({s for r in results for s in r["seen"]}),
            "params": max(r["params"] for r in results)}


def check(runs: list[dict[str, Any]]) -> list[str]:
    """Problems: a run that failed or measured nothing, a CP forward that saw the whole sequence, a loss that
    differs from cp 1's at the same length (relative ``LOSS_RTOL``)."""
    problems = []
    reference = {run["seq"]: run for run in runs if run["cp"] == 1 and "error" not in run}
    for run in runs:
        name = f"cp {run['cp']} seq {run['seq']}"
        if "error" in run:
            problems.append(f"{name} failed: {run['error']}")
            continue
        if not (run["step_s"] > 0 and run["peak_mib"] >= 0 and len(run["losses"]) > 0):
            problems.append(f"{name} measured nothing: {run}")
        if run["seen"] != [run["seq"] // run["cp"]]:
            problems.append(f"{name}: the forward saw {run['seen']} positions, not {run['seq'] // run['cp']}")
        if run["cp"] > 1:
            want = reference.get(run["seq"])
            if want is None:
                problems.append(f"{name}: no cp 1 run to compare with")
                continue
            for step, (a, b) in enumerate(zip(want["losses"], run["losses"], strict=True)):
                if abs(a - b) > LOSS_RTOL * abs(a):
                    problems.append(f"{name} step {step + 1}: loss {b:.6f} vs cp 1 {a:.6f}")
    return problems


def report(runs: list[dict[str, Any]]) -> None:
    cps = sorted({run["cp"] for run in runs})
    by = {(run["cp"], run["seq"]): run for run in runs}
    print("per rank (worst rank), medians over steps: step peak = anonymous memory the step adds (MiB); "
          "x = against cp 1 at that length")
    print(f"{'seq':>6} " + " ".join(f"{'cp ' + str(cp) + ' MiB':>11} {'s/step':>7} {'mem x':>6} {'time x':>6}"
                                     for cp in cps))
    for seq in sorted({run["seq"] for run in runs}):
        cells = []
        base = by.get((1, seq), {})
        for cp in cps:
            run = by.get((cp, seq), {})
            if "step_s" not in run:
                cells.append(f"{'failed' if 'error' in run else '-':>11} {'':>7} {'':>6} {'':>6}")
                continue
            mem_x = f"{run['peak_mib'] / base['peak_mib']:.2f}" if base.get("peak_mib") else "-"
            time_x = f"{run['step_s'] / base['step_s']:.2f}" if base.get("step_s") else "-"
            cells.append(f"{run['peak_mib']:11.1f} {run['step_s']:7.2f} {mem_x:>6} {time_x:>6}")
        print(f"{seq:6d} " + " ".join(cells))
    print("losses per step:")
    for run in runs:
        if "losses" in run:
            print(f"  cp {run['cp']} seq {run['seq']:6d} saw {run['seen']}: "
                  + " ".join(f"{loss:.6f}" for loss in run["losses"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI size (cp 1 and 2, tiny lengths); asserts")
    parser.add_argument("--seqs", type=int, nargs="+", help=f"sequence lengths (default {FULL['seqs']}, --quick "
                                                            f"{QUICK['seqs']}); divisible by 2 x every cp")
    parser.add_argument("--cps", type=int, nargs="+", help=f"cp sizes (default {FULL['cps']}); 1 is the reference")
    for key in ("hidden", "layers", "intermediate", "vocab", "heads", "steps"):
        parser.add_argument(f"--{key}", type=int, help=f"default {FULL[key]} (--quick: {QUICK[key]})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per (cp, length) run")
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    size = {key: getattr(args, key) if getattr(args, key) is not None else preset[key] for key in preset}
    if 1 not in size["cps"]:
        parser.error("--cps must include 1: every cp run is compared with one process on the whole sequence")
    bad = [seq for seq in size["seqs"] for cp in size["cps"] if seq % (2 * cp)]
    if bad:
        parser.error(f"lengths {sorted(set(bad))} are not divisible by 2 x cp (ring attention's load-balanced "
                     f"chunks); pick multiples of {2 * max(size['cps'])}")

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # real_size, for the ranks too
    from shardadopt.testing import RankPool

    env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
           # accelerate sets torch's threads from OMP_NUM_THREADS (unset: the cores over the ranks)
           "SHARDADOPT_THREADS_PER_RANK": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"model: llama hidden={size['hidden']} layers={size['layers']} intermediate={size['intermediate']} "
          f"vocab={size['vocab']} heads={size['heads']} fp32 sdpa; lengths {size['seqs']}, cp {size['cps']} "
          f"(fsdp_size=cp, cp ranks of {args.threads} thread(s) each on {os.cpu_count()} cores), batch 1, "
          f"{size['steps']} steps; load average {load:.1f}", flush=True)
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="long-context-") as root:
        model_path = write_llama(root, size, max(size["seqs"]))
        pools: dict[int, Any] = {}
        try:
            for seq in size["seqs"]:
                for cp in size["cps"]:
                    # fresh ranks per run, so that no run inherits another's heap (an earlier, longer run's freed
                    # pages); --quick keeps one pool per cp (seconds, not a measurement)
                    if cp not in pools:
                        pools[cp] = RankPool(cp, env=env)
                    results = pools[cp].run(rank_run, model_path, seq, size["steps"], size["vocab"],
                                            timeout=args.timeout)
                    if not args.quick:
                        pools.pop(cp).close()
                    runs.append(summarize(cp, seq, results))
                    run = runs[-1]
                    print(f"  cp {cp} seq {seq}: " + (f"{run['step_s']:.2f} s/step, step peak "
                                                       f"{run['peak_mib']:.1f} MiB" if "error" not in run
                                                       else "failed"), flush=True)
        finally:
            for pool in pools.values():
                pool.close()
    print(f"--- {time.perf_counter() - started:.0f} s")
    report(runs)
    problems = check(runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "threads": args.threads, "runs": runs}, f, indent=1)
    for problem in problems:
        print("PROBLEM:", problem)
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
