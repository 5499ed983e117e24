"""benchmarks/real_size.py --quick: the paths a user picks between (load-time sharding with shardadopt, FSDP and TP;
accelerate's own FSDP2 prepare path; DDP) train to the same losses, and the load-time-sharded ranks hold no more
than their shard (plus the largest parameter and a stated margin) through load and prepare."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "real_size.py"


def test_quick_paths_agree_and_shards_stay_shards():
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--paths", "shardadopt", "shardadopt-tp",
                          "accelerate-fsdp2", "ddp"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("OK"), out.stdout + out.stderr
    for path in ("shardadopt ", "shardadopt-tp ", "accelerate-fsdp2 ", "ddp "):
        assert f"\n  {path}" in out.stdout, out.stdout  # every path reported its losses
