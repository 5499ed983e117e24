"""benchmarks/gpu_check.py, the one-command GPU session, as far as a CPU machine can run it: its argument handling
and its process-group items on gloo/CPU (``--device cpu``), so the script a GPU session gets has run before."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
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


def test_cpu_dry_run_of_the_process_group_items():
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--only", "grouped-mm-sentinel",
                          *RANK_ITEMS], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    for item in RANK_ITEMS:
        assert f"PASS  {item}" in out.stdout, out.stdout
    assert "SKIP  grouped-mm-sentinel" in out.stdout
    assert "3 passed, 0 failed, 1 skipped" in out.stdout
