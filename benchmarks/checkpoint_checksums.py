"""What the completion marker's per-file checksums cost at save and at load, at the real size, side by side.

On N gloo ranks, the 245M Llama of ``benchmarks/real_size.py`` loaded with ``fsdp_size=N``, AdamW after one step
(weights and both moments: 2.7 GiB of state), saved and loaded with ``shardadopt.checkpoint`` in alternating rounds:
``checksums`` (the shipped path: the ranks hash the files between them at save, and again before a load) and
``without`` (the same calls with the hashing and the check replaced by no-ops, what the previous release did).
Reports per path the median save and load wall time (rank 0, between barriers) and the ratios.

    python benchmarks/checkpoint_checksums.py              # 245M Llama, 2 ranks, 3 rounds
    python benchmarks/checkpoint_checksums.py --quick      # a small model, 1 round
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_size import FULL, QUICK  # noqa: E402  (the same model sizes)


def write_model(root: str, size: dict[str, int]) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(root, "llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["intermediate"],
                         num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                         num_key_value_heads=size["kv_heads"], max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def measure(path: str, root: str, rounds: int) -> dict[str, Any]:
    """Every rank: load, one AdamW step, then ``rounds`` of (save, load) per path, alternating."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import shardadopt
    from shardadopt import checkpoint
    from shardadopt.checkpoint import publish, resume

    shardadopt.enable()
    world = dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(fsdp_size=world))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    manifest, verify = publish.manifest, resume.verify
    times: dict[str, dict[str, list[float]]] = {p: {"save": [], "load": []} for p in ("checksums", "without")}
    size = 0
    for i in range(rounds):
        for name in (("checksums", "without") if i % 2 == 0 else ("without", "checksums")):
            if name == "without":
                publish.manifest, resume.verify = (lambda *a, **k: {}), (lambda *a, **k: None)
            directory = os.path.join(root, f"ckpt-{name}")
            dist.barrier()
            start = time.perf_counter()
            checkpoint.save(directory, model, optimizer, step=1)
            dist.barrier()
            times[name]["save"].append(time.perf_counter() - start)
            start = time.perf_counter()
            checkpoint.load(directory, model, optimizer)
            dist.barrier()
            times[name]["load"].append(time.perf_counter() - start)
            publish.manifest, resume.verify = manifest, verify
            if dist.get_rank() == 0:
                size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs)
                shutil.rmtree(directory)
            dist.barrier()
    return {"times": times, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    rounds = args.rounds or (1 if args.quick else 3)
    from shardadopt.testing import RankPool

    with tempfile.TemporaryDirectory() as root:
        path = write_model(root, size)
        with RankPool(args.ranks) as pool:
            result = pool.run(measure, path, root, rounds, timeout=3600)[0]
    report: dict[str, Any] = {"gib": result["bytes"] / 2**30, "rounds": rounds, "ranks": args.ranks}
    for op in ("save", "load"):
        for name, per in result["times"].items():
            report[f"{op} {name} median s"] = statistics.median(per[op])
            report[f"{op} {name} all s"] = per[op]
        report[f"{op} ratio"] = report[f"{op} checksums median s"] / report[f"{op} without median s"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
