"""What load-time sharding buys at a real size, against what users would pick instead, measured side by side.

The same user loop (accelerate, AdamW, ``clip_grad_norm_``, fixed token batches) on one generated Llama checkpoint,
through each way of training it on N gloo ranks, each run in fresh rank processes, the paths alternating by round:

- ``shardadopt``: ``from_pretrained(distributed_config=DistributedConfig(fsdp_size=N))``, ``shardadopt.enable()``;
- ``shardadopt-pc``: the same load under ``Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=N))``;
- ``shardadopt-tp``: ``tp_size=N``; ``shardadopt-2d``: ``fsdp_size=2, tp_size=2`` (4 ranks only);
- ``accelerate-fsdp2``: the whole model loaded on every rank and sharded by accelerate's own ``fsdp2_prepare_model``
  in ``prepare``. accelerate 1.16 ignores ``FullyShardedDataParallelPlugin(fsdp_version=2)`` on CPU and DDP-wraps;
  this path sets the accelerator's state to FSDP after ``Accelerator()``, which no user can do, so its step time is
  indicative only (on GPUs it is the real alternative);
- ``ddp``: the whole model on every rank, DDP-wrapped by ``prepare``.

Per rank and phase (load, prepare, steps) it reports peak RSS and peak anonymous memory (``RssAnon`` of
``/proc/self/status``, sampled every millisecond: safetensors pages are mapped, not read, so RSS right after
``from_pretrained`` is the same for every path, and only anonymous memory says what a rank holds), load and prepare
time, the median step, and the global-batch loss of every step, which must agree across paths. Within each step
it also records the anonymous-memory peak of forward, backward, clipping and the optimizer step, and what each
leaves behind (where the step peak goes: docs/benchmarks.md).

    python benchmarks/real_size.py                       # the issue's size: 245M Llama, 2 ranks, 3 steps, 2 rounds
    python benchmarks/real_size.py --quick               # CI: a small model; asserts agreement and the shard bound
    python benchmarks/real_size.py --paths shardadopt --checkpointing --reshard-all --trim   # the step-peak options
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

GIB = 2**30
MIB = 2**20
PATHS = ("shardadopt", "shardadopt-pc", "shardadopt-tp", "shardadopt-2d", "accelerate-fsdp2", "ddp")
# The model (hidden 1024, 14 layers, intermediate 2816, vocab 32000: 245M parameters, fp32) and a quick one.
FULL = {"hidden": 1024, "layers": 14, "intermediate": 2816, "vocab": 32000, "heads": 16, "kv_heads": 16, "seq": 256,
        "batch": 2, "steps": 3, "rounds": 2}
QUICK = {"hidden": 512, "layers": 8, "intermediate": 1408, "vocab": 8000, "heads": 8, "kv_heads": 8, "seq": 64,
         "batch": 2, "steps": 3, "rounds": 1}
# --quick's bound on what the shardadopt path holds through load and prepare, above the rank's anonymous memory
# before loading: its shard of the parameters, plus the largest whole parameter (a checkpoint tensor may be read whole
# before it is sliced), plus 16 MiB for the meshes' and transformers' own bookkeeping. The whole model is well above
# it at the quick size (a load that materialised it would fail).
QUICK_SLACK = 16 * MIB
LOSS_RTOL = 1e-4  # the global-batch losses of different paths: float32 sums in other orders


def _status() -> tuple[int, int]:
    """(VmRSS, RssAnon) of this process in bytes."""
    rss = anon = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
    return rss, anon


class Sampler:
    """Samples RSS and anonymous memory every millisecond; :meth:`mark` closes a segment: its peaks and end values."""

    def __init__(self) -> None:
        self.rss, self.anon = _status()
        self.peak_rss, self.peak_anon = self.rss, self.anon
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._take()
            time.sleep(0.001)

    def _take(self) -> None:
        rss, anon = _status()
        with self._lock:
            self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)
            self.rss, self.anon = rss, anon

    def mark(self) -> dict[str, int]:
        """Peaks since the previous mark, and the values now; the next segment starts here."""
        self._take()
        with self._lock:
            segment = {"peak_rss": self.peak_rss, "peak_anon": self.peak_anon, "rss": self.rss, "anon": self.anon}
            self.peak_rss, self.peak_anon = self.rss, self.anon
        return segment

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def write_llama(root: str, size: dict[str, int]) -> str:
    """A randomly initialised Llama checkpoint (seed 0, fp32, untied head) of ``size`` under ``root``; its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(root, "llama-h{hidden}-l{layers}-i{intermediate}-v{vocab}".format(**size))
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"],
                             intermediate_size=size["intermediate"], num_hidden_layers=size["layers"],
                             num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
                             max_position_embeddings=max(size["seq"], 512), tie_word_embeddings=False)
        LlamaForCausalLM(config).save_pretrained(path)
    return path


def _sizes(path_kind: str, world: int) -> dict[str, int] | None:
    """The DistributedConfig sizes a path loads with (None: a whole load)."""
    return {"shardadopt": {"fsdp_size": world}, "shardadopt-pc": {"fsdp_size": world},
            "shardadopt-tp": {"tp_size": world}, "shardadopt-2d": {"fsdp_size": world // 2, "tp_size": 2}
            }.get(path_kind)


def _accelerator(path_kind: str, world: int) -> Any:
    from shardadopt.testing.accelerator import fresh_accelerator

    if path_kind == "shardadopt-pc":
        from accelerate import ParallelismConfig

        return fresh_accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_shard_size=world))
    if path_kind != "accelerate-fsdp2":
        return fresh_accelerator(cpu=True)
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    accelerator = fresh_accelerator(cpu=True, fsdp_plugin=plugin)
    # what no user can do: on CPU accelerate left the plugin out (MULTI_CPU); put it in
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    return accelerator


def _trim() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _warm_up() -> None:
    """One training step of a tiny Llama: what the first step imports and initialises lazily (torch._dynamo's
    modules, kernels' scratch) is in the base, not charged to the first path measured."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def rank_run(path_kind: str, model_path: str, size: dict[str, int], options: dict[str, bool]) -> dict[str, Any]:
    """One path on this rank: load, prepare, ``size["steps"]`` steps; memory per phase and per step segment."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import shardadopt

    _warm_up()
    world = dist.get_world_size()
    sizes = _sizes(path_kind, world)
    if sizes is not None:
        shardadopt.enable()
    gc.collect()
    _trim()
    dist.barrier()
    sampler = Sampler()
    try:
        phases: dict[str, Any] = {"base": sampler.mark()}
        start = time.perf_counter()
        kwargs: dict[str, Any] = {"dtype": torch.float32}
        if sizes is not None:
            from transformers.distributed import DistributedConfig

            kwargs["distributed_config"] = DistributedConfig(**sizes)
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
        load_s = time.perf_counter() - start
        phases["load"] = sampler.mark()
        if options.get("checkpointing"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if options.get("reshard_all"):
            from torch.distributed.fsdp import FSDPModule

            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_reshard_after_forward(True, recurse=False)
        dist.barrier()
        sampler.mark()
        start = time.perf_counter()
        accelerator = _accelerator(path_kind, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        model, optimizer = accelerator.prepare(model, optimizer)
        prepare_s = time.perf_counter() - start
        phases["prepare"] = sampler.mark()
        shard = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                    for p in model.parameters())
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        losses, step_s, steps = [], [], []
        dp = world // (sizes or {}).get("tp_size", 1)
        generator = torch.Generator().manual_seed(1234)
        model.train()
        for _ in range(size["steps"]):
            batch = torch.randint(0, size["vocab"], (size["batch"] * world, size["seq"]), generator=generator)
            rows = batch.view(dp, -1, size["seq"])[accelerator.process_index * dp // world]
            dist.barrier()
            sampler.mark()
            start = time.perf_counter()
            segments = {}
            loss = model(input_ids=rows, labels=rows).loss
            segments["forward"] = sampler.mark()
            accelerator.backward(loss)
            segments["backward"] = sampler.mark()
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            segments["clip"] = sampler.mark()
            optimizer.step()
            segments["step"] = sampler.mark()
            optimizer.zero_grad()
            if options.get("trim"):
                _trim()
            segments["zero_grad"] = sampler.mark()
            step_s.append(time.perf_counter() - start)
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
            steps.append(segments)
        wrapper = type(model).__name__
        del model, optimizer
        accelerator.free_memory()
        return {"rank": dist.get_rank(), "phases": phases, "steps": steps, "losses": losses, "load_s": load_s,
                "prepare_s": prepare_s, "step_s": statistics.median(step_s) if step_s else float("nan"),
                "shard": shard, "largest": largest, "wrapper": wrapper}
    finally:
        sampler.close()
        shardadopt.disable()


def _peak(result: dict[str, Any], key: str, phases: tuple[str, ...]) -> int:
    return max(result["phases"][p][key] for p in phases)


def summarize(path_kind: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one run of a path: per rank, then the worst rank."""
    through_prepare = ("load", "prepare")
    rows = []
    for r in results:
        base = r["phases"]["base"]["anon"]
        step_peak = max((s["peak_anon"] for step in r["steps"] for s in step.values()), default=base)
        step_peak_rss = max((s["peak_rss"] for step in r["steps"] for s in step.values()), default=0)
        rows.append({
            "rank": r["rank"], "base_anon": base, "shard": r["shard"], "largest": r["largest"],
            "load_rss": r["phases"]["load"]["rss"], "load_anon": r["phases"]["load"]["anon"],
            "prepare_peak_rss": _peak(r, "peak_rss", through_prepare),
            "prepare_peak_anon": _peak(r, "peak_anon", through_prepare),
            "prepare_anon": r["phases"]["prepare"]["anon"],
            "step_peak_rss": step_peak_rss, "step_peak_anon": step_peak,
            "step_parts": [{name: {"peak": s["peak_anon"] - base, "after": s["anon"] - base}
                            for name, s in step.items()} for step in r["steps"]],
        })
    return {"path": path_kind, "wrapper": results[0]["wrapper"], "losses": results[0]["losses"], "ranks": rows,
            "load_s": max(r["load_s"] for r in results), "prepare_s": max(r["prepare_s"] for r in results),
            "step_s": max(r["step_s"] for r in results)}


def check_agreement(runs: list[dict[str, Any]]) -> list[str]:
    """Problems: losses of a path that differ from the first path's (relative ``LOSS_RTOL``)."""
    problems = []
    reference = runs[0]
    for run in runs[1:]:
        for step, (a, b) in enumerate(zip(reference["losses"], run["losses"])):
            if abs(a - b) > LOSS_RTOL * abs(a):
                problems.append(f"step {step + 1}: {run['path']} loss {b:.6f} vs {reference['path']} {a:.6f}")
    return problems


def check_shard_bound(run: dict[str, Any]) -> list[str]:
    """Problems: a rank of a load-time-sharded path that held more than its shard + the largest parameter +
    ``QUICK_SLACK`` above its base through load and prepare."""
    problems = []
    for row in run["ranks"]:
        held = row["prepare_peak_anon"] - row["base_anon"]
        bound = row["shard"] + row["largest"] + QUICK_SLACK
        if held > bound:
            problems.append(f"{run['path']} rank {row['rank']}: held {held / MIB:.1f} MiB through prepare, over its "
                            f"shard {row['shard'] / MIB:.1f} + largest parameter {row['largest'] / MIB:.1f} + "
                            f"{QUICK_SLACK / MIB:.0f} MiB")
    return problems


def report(runs: list[dict[str, Any]]) -> None:
    gib = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    print("per rank, GiB (worst rank); anon = anonymous memory above the rank's base before loading")
    print(f"{'path':18} {'wrapper':24} {'load anon':>9} {'prep RSS':>8} {'prep anon':>9} {'step RSS':>8} "
          f"{'step anon':>9} {'load s':>7} {'prep s':>7} {'step s':>7}")
    for run in runs:
        worst = lambda key, ranks=run["ranks"]: max(r[key] for r in ranks)  # noqa: E731
        base = max(r["base_anon"] for r in run["ranks"])
        print(f"{run['path']:18} {run['wrapper'][:24]:24} {gib(worst('load_anon') - base):>9} "
              f"{gib(worst('prepare_peak_rss')):>8} {gib(worst('prepare_peak_anon') - base):>9} "
              f"{gib(worst('step_peak_rss')):>8} {gib(worst('step_peak_anon') - base):>9} {run['load_s']:7.2f} "
              f"{run['prepare_s']:7.2f} {run['step_s']:7.2f}")
    print("last step, rank 0, anonymous memory above base (GiB): peak during / left after each part")
    for run in runs:
        parts = (run["ranks"][0]["step_parts"] or [{}])[-1]
        print(f"  {run['path']:18} " + "  ".join(f"{name} {gib(p['peak'])}/{gib(p['after'])}"
                                                  for name, p in parts.items()))
    print("losses per step:")
    for run in runs:
        print(f"  {run['path']:18} " + " ".join(f"{loss:.6f}" for loss in run["losses"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI size; asserts agreement and the shard bound")
    parser.add_argument("--paths", nargs="+", choices=PATHS, help="default: every path the world size allows")
    parser.add_argument("--ranks", type=int, default=2)
    for key, value in FULL.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"default {value} (--quick: {QUICK[key]})")
    parser.add_argument("--checkpointing", action="store_true", help="model.gradient_checkpointing_enable()")
    parser.add_argument("--reshard-all", action="store_true",
                        help="every FSDP2 module of a load-time-sharded model reshards after forward")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) after every step's zero_grad")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--env", nargs="+", default=[], metavar="KEY=VALUE",
                        help="environment of the ranks (MALLOC_ARENA_MAX=2, MALLOC_MMAP_THRESHOLD_=131072, ...)")
    parser.add_argument("--json", help="write the runs here")
    args = parser.parse_args(argv)
    size = {key: getattr(args, key) if getattr(args, key) is not None else (QUICK if args.quick else FULL)[key]
            for key in FULL}
    paths = args.paths or [p for p in PATHS if p != "shardadopt-2d" or args.ranks == 4]
    options = {"checkpointing": args.checkpointing, "reshard_all": args.reshard_all, "trim": args.trim}
    from shardadopt.testing import RankPool

    env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "SHARDADOPT_THREADS_PER_RANK": str(args.threads)}
    os.environ.update(item.split("=", 1) for item in args.env)  # before the ranks start: glibc reads MALLOC_* then
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    print(f"model: llama hidden={size['hidden']} layers={size['layers']} intermediate={size['intermediate']} "
          f"vocab={size['vocab']} fp32; {args.ranks} gloo ranks, seq {size['seq']}, per-rank batch {size['batch']}, "
          f"{size['steps']} steps, {size['rounds']} round(s); options {options}, env {args.env}; "
          f"load average {load[0]:.1f}")
    rounds: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="real-size-") as root:
        model_path = write_llama(root, size)
        for round_index in range(size["rounds"]):
            order = paths if round_index % 2 == 0 else paths[::-1]
            runs = {}
            if args.quick:  # one pool for every path: the first (shardadopt, the bound's) runs in fresh processes
                with RankPool(args.ranks, env=env) as pool:
                    for path_kind in order:
                        runs[path_kind] = summarize(path_kind, pool.run(rank_run, path_kind, model_path, size,
                                                                        options, timeout=600))
            else:  # fresh rank processes for every run: no path inherits another's heap
                for path_kind in order:
                    with RankPool(args.ranks, env=env) as pool:
                        results = pool.run(rank_run, path_kind, model_path, size, options, timeout=3600)
                    runs[path_kind] = summarize(path_kind, results)
            rounds.append([runs[p] for p in paths])
            print(f"--- round {round_index + 1} (order: {' '.join(order)})")
            report(rounds[-1])
    problems = [p for runs in rounds for p in check_agreement(runs)]
    if args.quick:
        problems += check_shard_bound(rounds[0][0]) if paths[0] == "shardadopt" else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "ranks": args.ranks, "options": options, "rounds": rounds}, f, indent=1)
    for problem in problems:
        print("PROBLEM:", problem)
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
