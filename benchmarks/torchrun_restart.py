"""How long a job restarted by torchrun takes to train again: from the kill to the first resumed step, side by side
with a cold start (torchrun launched to the first step) in the same run.

    python benchmarks/torchrun_restart.py --layout fsdp --kill backward --repeats 3

Each repeat runs ``shardadopt/testing/torchrun_worker.py`` (the accelerate loop, save_state every step, resume from
``shardadopt.checkpoint.latest``; a tiny Qwen3 on 2 gloo ranks) twice under ``torchrun`` with its default
settings: uninterrupted (the cold start: launch to step 1 done) and with rank 1 SIGKILLed in step 3 (``--kill
backward``: in its backward; ``save``: inside its save_state) under ``--max-restarts 1`` (the restart: the kill to
the resumed step 3 done). The restart pays what a cold start pays plus torchrun noticing the death and stopping the
other rank, and the checkpoint load. Prints one line per repeat and the medians with their ratio.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import shardadopt.testing
from shardadopt.testing import tiny_checkpoints

WORKER = Path(shardadopt.testing.__file__).with_name("torchrun_worker.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(model: str, layout: str, work: Path, kill: str) -> tuple[float, list[dict], float | None]:
    """One torchrun job: (launch time, rank 0's step records, the kill time or None)."""
    work.mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "--max-restarts", "1" if kill != "none" else "0", str(WORKER), "--model", model,
               "--layout", layout, "--work", str(work), "--kill", kill]
    launched = time.time()
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"torchrun exited {done.returncode}:\n{done.stderr[-4000:]}")
    steps = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines()]
    killed = work / "killed"
    return launched, steps, json.loads(killed.read_text().splitlines()[0])["time"] if killed.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=["fsdp", "tp"], default="fsdp")
    parser.add_argument("--kill", choices=["backward", "save"], default="backward")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        model = tiny_checkpoints(Path(root) / "models", ["qwen3"])["qwen3"]
        cold, restart = [], []
        for repeat in range(args.repeats):
            launched, steps, _ = run(model, args.layout, Path(root) / f"cold-{repeat}", "none")
            cold.append(steps[0]["time"] - launched)
            _, steps, killed = run(model, args.layout, Path(root) / f"restart-{repeat}", args.kill)
            first_resumed = min(s["time"] for s in steps if s["resumed_at"] != 0)
            restart.append(first_resumed - killed)
            print(f"repeat {repeat}: cold start {cold[-1]:.1f} s, kill to first resumed step {restart[-1]:.1f} s",
                  flush=True)
    print(f"{args.layout}, kill in {args.kill}: median cold start {statistics.median(cold):.1f} s, median kill to "
          f"first resumed step {statistics.median(restart):.1f} s "
          f"({statistics.median(restart) / statistics.median(cold):.2f}x)")


if __name__ == "__main__":
    main()
