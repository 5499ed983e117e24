"""benchmarks/gpu_check.py, the one-command GPU session, as far as a CPU machine can run it: its argument handling
and every item on gloo/CPU (``--nproc 2 --dry-run``), so the script a GPU session gets has run before."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
RANK_ITEMS = ["fused-adamw-mesh", "checkpoint-cuda-rng", "hpo-gloo-beside-nccl"]


def _script(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_lists_items_and_refuses_unknown_ones(capsys, monkeypatch):
    gpu_check = _script(monkeypatch)
    assert gpu_check.main(["--list"]) == 0
    assert capsys.readouterr().out.split() == [item.name for item in gpu_check.ITEMS]
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(["--only", "no-such-item"])
    assert exc.value.code == 2 and "known:" in capsys.readouterr().err


def test_dry_run_on_two_ranks_runs_every_item():
    """``gpu_check.py --nproc 2 --dry-run``: every item's code path on gloo/CPU (the selftest item on two of its
    scenarios, one of them skipped on 2 ranks), so the GPU session's one command has run before."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--nproc", "2", "--dry-run", "--budget", "1500",
                          "--timeout", "600", "--scenarios", "accelerate-fsdp", "accelerate-2d"],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout + out.stderr
    for item in ["environment", *RANK_ITEMS, "fence-fault", "fence-hang", "bf16-parity", "selftest"]:
        assert f"PASS  {item}" in out.stdout, out.stdout
    assert "SKIP  grouped-mm-sentinel" in out.stdout
    # each fence item: every rank broke its groups (the count per rank is the breaks times the groups: a loaded
    # machine can see the watcher's second break too)
    aborts = re.findall(r"last of 2 ranks out .*?ProcessGroup\.abort\(\) calls per rank: \[(\d+), (\d+)\]", out.stdout)
    assert len(aborts) == 2 and all(int(n) >= 1 for pair in aborts for n in pair), out.stdout
    assert "      SKIP  accelerate-2d" in out.stdout and "1 passed, 0 failed, 1 skipped" in out.stdout, out.stdout
    assert "8 passed, 0 failed, 1 skipped" in out.stdout, out.stdout
