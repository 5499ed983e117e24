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
    for item in ["environment", *RANK_ITEMS, "fence-fault", "fence-hang", "bf16-parity", "cp-ring-attention",
                 "selftest"]:
        assert f"PASS  {item}" in out.stdout, out.stdout
    assert "SKIP  grouped-mm-sentinel" in out.stdout
    # each fence item: every rank broke its groups (the count per rank is the breaks times the groups: a loaded
    # machine can see the watcher's second break too)
    aborts = re.findall(r"last of 2 ranks out .*?ProcessGroup\.abort\(\) calls per rank: \[(\d+), (\d+)\]", out.stdout)
    assert len(aborts) == 2 and all(int(n) >= 1 for pair in aborts for n in pair), out.stdout
    assert "      SKIP  accelerate-2d" in out.stdout and "1 passed, 0 failed, 1 skipped" in out.stdout, out.stdout
    # ring attention on an adopted model (fsdp_size=2 x cp_size=2) against one process, each forward on half
    assert "llama fsdp_size=2 x cp_size=2 on cpu, 64 tokens (32 per forward)" in out.stdout, out.stdout
    assert "9 passed, 0 failed, 1 skipped" in out.stdout, out.stdout


def test_cp_item_skips_what_cannot_split(capsys, monkeypatch):
    """Context parallelism over one rank means nothing: the item skips with the reason. On one GPU it would let 2
    ranks share it over gloo, and skips with the device check's reason when gloo cannot carry CUDA tensors there."""
    gpu_check = _script(monkeypatch)
    assert gpu_check.main(["--dry-run", "--nproc", "1", "--only", "cp-ring-attention"]) == 0
    assert "SKIP  cp-ring-attention" in capsys.readouterr().out
    import torch

    from shardadopt.selftest import device_check

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(device_check, "gloo_collectives_problem", lambda device, timeout: f"{device}: SIGSEGV")
    args = gpu_check.argparse.Namespace(device="cuda", nproc=1, timeout=10.0)
    status, detail = gpu_check.cp_ring_attention(args, {"deadline": gpu_check.time.monotonic() + 60})
    assert status == "SKIP" and "one GPU" in detail and "cuda: SIGSEGV" in detail, detail
