"""Peak memory of a VLM training step sharded at load time, with and without transformers-fsdp-plan-unmatched-units.

A generated Qwen2.5-VL whose vision tower is most of the model (the language model small), loaded with
``DistributedConfig(fsdp_size=N)`` on N gloo ranks after ``shardadopt.enable()`` (``patched``: the vision blocks
are FSDP units of their own) or ``shardadopt.enable(exclude=[that patch])`` (``upstream``: they sit in the root unit,
gathered whole at every forward), trained by the same accelerate loop on the same image-text samples
(``shardadopt/testing/vlm.py``). Each run in fresh rank processes, the two alternating by round. Per rank and
phase it reports the peak anonymous memory (``RssAnon``, sampled every millisecond, as ``benchmarks/real_size.py``
measures it) above the rank's base before loading, and the global-batch loss of every step, which must agree.

    python benchmarks/vlm_memory.py                  # vision tower 16 blocks x 768 wide (~150M), 2 ranks, 2 rounds
    python benchmarks/vlm_memory.py --depth 4 --width 256 --rounds 1    # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from real_size import GIB, LOSS_RTOL, Sampler, _trim, _warm_up  # noqa: E402

PATCH = "transformers-fsdp-plan-unmatched-units"
PATHS = ("patched", "upstream")
SAMPLES_PER_RANK = 2


def write_vlm(root: str, depth: int, width: int) -> str:
    """A random Qwen2.5-VL (seed 0, fp32): a vision tower of ``depth`` blocks ``width`` wide, a 2-layer language
    model 256 wide; its path, with the samples of ``shardadopt.testing.vlm`` written next to it."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from shardadopt.testing.vlm import samples

    path = os.path.join(root, f"qwen2_5_vl-d{depth}-w{width}")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        config = Qwen2_5_VLConfig(
            text_config={"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
                         "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12],
                                             "rope_theta": 10000.0}},
            vision_config={"depth": depth, "hidden_size": width, "intermediate_size": 4 * width,
                           "num_heads": width // 64, "out_hidden_size": 256, "fullatt_block_indexes": [depth - 1],
                           "window_size": 112},
            image_token_id=1000, video_token_id=1001, vision_start_token_id=1002, vision_end_token_id=1003)
        config.use_cache = False
        model = Qwen2_5_VLForConditionalGeneration(config)
        model.save_pretrained(path)
        rows = samples("qwen2_5_vl", model, 16, seed=1234)
        torch.save(rows, os.path.join(path, "samples.pt"))
        counts = {"vision": sum(p.numel() for p in model.model.visual.parameters())}
        counts["language"] = sum(p.numel() for p in model.parameters()) - counts["vision"]
        with open(os.path.join(path, "counts.json"), "w") as f:
            json.dump(counts, f)
    return path


def rank_run(path_kind: str, model_path: str, steps: int) -> dict[str, Any]:
    """One path on this rank: load, prepare, ``steps`` steps; peak anonymous memory per phase, losses."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForImageTextToText
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt.testing.accelerator import fresh_accelerator
    from shardadopt.testing.vlm import collate

    _warm_up()
    world, rank = dist.get_world_size(), dist.get_rank()
    shardadopt.enable(exclude=[PATCH] if path_kind == "upstream" else [])
    rows = torch.load(os.path.join(model_path, "samples.pt"))
    gc.collect()
    _trim()
    dist.barrier()
    sampler = Sampler()
    try:
        phases = {"base": sampler.mark()}
        model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32,
                                                            distributed_config=DistributedConfig(fsdp_size=world))
        phases["load"] = sampler.mark()
        units = sum(isinstance(m, FSDPModule) for m in model.modules())
        accelerator = fresh_accelerator(cpu=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        model, optimizer = accelerator.prepare(model, optimizer)
        phases["prepare"] = sampler.mark()
        model.train()
        losses, step_s, per_step = [], [], SAMPLES_PER_RANK * world
        for step in range(steps):
            batch = collate(rows[step * per_step + rank * SAMPLES_PER_RANK:
                                 step * per_step + (rank + 1) * SAMPLES_PER_RANK])
            dist.barrier()
            sampler.mark()
            start = time.perf_counter()
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            step_s.append(time.perf_counter() - start)
            phases[f"step{step}"] = sampler.mark()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
        return {"rank": rank, "phases": phases, "losses": losses, "units": units, "step_s": step_s}
    finally:
        sampler.close()
        shardadopt.disable()


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Worst rank's peak anonymous memory above its base: through load and prepare, and over the steps."""
    def above(r: dict[str, Any], names: list[str]) -> int:
        return max(r["phases"][n]["peak_anon"] for n in names) - r["phases"]["base"]["anon"]

    steps = [n for n in results[0]["phases"] if n.startswith("step")]
    return {"load": max(above(r, ["load", "prepare"]) for r in results),
            "step": max(above(r, steps) for r in results),
            "units": results[0]["units"], "losses": results[0]["losses"],
            "step_s": sorted(results[0]["step_s"])[len(results[0]["step_s"]) // 2]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    from shardadopt.testing import RankPool

    env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error", "SHARDADOPT_THREADS_PER_RANK": "1"}
    problems = []
    with tempfile.TemporaryDirectory(prefix="vlm-memory-") as root:
        path = write_vlm(root, args.depth, args.width)
        counts = json.loads(open(os.path.join(path, "counts.json")).read())
        print(f"model: Qwen2.5-VL, vision tower {args.depth} blocks x {args.width} "
              f"({counts.get('vision', 0) / 1e6:.0f}M parameters), language model "
              f"{counts.get('language', 0) / 1e6:.0f}M; fp32, {args.ranks} gloo ranks, fsdp_size={args.ranks}, "
              f"{SAMPLES_PER_RANK} image-text samples per rank, {args.steps} steps; load average "
              f"{os.getloadavg()[0]:.1f}")
        for round_index in range(args.rounds):
            order = PATHS if round_index % 2 == 0 else PATHS[::-1]
            runs = {}
            for path_kind in order:
                with RankPool(args.ranks, env=env) as pool:
                    runs[path_kind] = summarize(pool.run(rank_run, path_kind, path, args.steps, timeout=3600))
            print(f"--- round {round_index + 1} (order: {' '.join(order)}); GiB of anonymous memory above the base, "
                  "worst rank")
            print(f"{'path':10} {'FSDP units':>10} {'load+prepare':>12} {'step peak':>9} {'step s':>7}  losses")
            for name in PATHS:
                run = runs[name]
                print(f"{name:10} {run['units']:>10} {run['load'] / GIB:12.3f} {run['step'] / GIB:9.3f} "
                      f"{run['step_s']:7.2f}  " + " ".join(f"{loss:.6f}" for loss in run["losses"]))
            ratio = runs["patched"]["step"] / runs["upstream"]["step"]
            print(f"step peak patched / upstream: {ratio:.2f}")
            for a, b in zip(runs["patched"]["losses"], runs["upstream"]["losses"]):
                if abs(a - b) > LOSS_RTOL * abs(b):
                    problems.append(f"round {round_index + 1}: losses differ ({a} vs {b})")
    for problem in problems:
        print("PROBLEM:", problem)
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
