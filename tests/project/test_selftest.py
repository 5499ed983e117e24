"""`shardadopt doctor` and `shardadopt selftest` as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardadopt.cli import main


def test_doctor_json_reports_versions_backends_and_patches(capsys):
    code = main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    names = {row["name"] for row in report["versions"]}
    assert {"torch", "transformers", "accelerate", "optuna", "wrapt"} <= names
    assert report["backends"]["gloo"] is True
    assert code == (0 if report["ok"] else 1)
    assert all(p["state"] in {"applied", "not-needed", "unsupported", "off"} for p in report["patches"])


def _selftest(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # accelerate's workers warn then
    return subprocess.run([sys.executable, "-m", "shardadopt", "selftest", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _log_path(stdout: str) -> Path:
    (line,) = [line for line in stdout.splitlines() if line.startswith("worker output: ")]
    return Path(line.removeprefix("worker output: "))


def test_selftest_cli_passes_on_two_cpu_ranks():
    """The real command, in a fresh process, as README's first line runs it: a clean table; what the workers
    print (upstream warnings) is in the log file it names."""
    out = _selftest("--nproc", "2", "--timeout", "240", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS  fsdp-load-grads" in out.stdout
    table = out.stdout.splitlines()
    assert table[0].startswith("shardadopt selftest:") and table[1].startswith("worker output: ")
    assert all(line.startswith(("PASS  ", "FAIL  ", "SKIP  ")) for line in table[2:-1]), out.stdout
    assert "SKIP  accelerate-2d" in out.stdout and "SKIP  accelerate-hsdp" in out.stdout, out.stdout
    assert table[-1].endswith(" 0 failed, 2 skipped"), out.stdout
    assert out.stderr == "", out.stderr
    log = _log_path(out.stdout).read_text()
    assert "=== accelerate-fsdp" in log and "OMP_NUM_THREADS/MKL_NUM_THREADS unset" in log, log[-2000:]


def test_selftest_shows_a_failed_scenarios_log_after_the_table():
    out = _selftest("--only", "fsdp-load-grads", "--timeout", "0.1", timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    log = _log_path(out.stdout)
    assert lines[2].startswith("FAIL  fsdp-load-grads") and "no answer within 0s" in lines[2], out.stdout
    assert f"--- fsdp-load-grads: last 40 lines of its log ({log}) ---" in lines[3:], out.stdout
    assert lines[-1] == "0 passed, 1 failed, 0 skipped" and log.is_file()
    assert out.stderr == "", out.stderr


def test_selftest_rejects_unknown_scenario(capsys):
    assert main(["selftest", "--only", "no-such-scenario"]) == 2
    assert "known:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["selftest", "--device", "tpu"], ["frobnicate"]])
def test_cli_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


CRASHING_RANK = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"


def _crashing_device_check(tmp_path, monkeypatch):
    """gloo_collectives_problem whose ranks die of SIGSEGV, as torch 2.11's gloo does on CUDA tensors."""
    import functools

    from shardadopt.selftest import device_check

    (tmp_path / "segfaulting_rank.py").write_text(CRASHING_RANK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return functools.partial(device_check.gloo_collectives_problem, module="segfaulting_rank")


def test_gloo_device_check_passes_where_gloo_works():
    from shardadopt.selftest.device_check import gloo_collectives_problem

    assert gloo_collectives_problem("cpu") is None


def test_gloo_device_check_asks_again_after_a_one_off_crash(tmp_path, monkeypatch):
    """Ranks that die of a signal on the first run only (an overloaded machine) leave no problem: asked again."""
    import functools

    from shardadopt.selftest import device_check

    (tmp_path / "crashes_once.py").write_text(
        "import os, signal, sys\n"
        f"marker = os.path.join({str(tmp_path)!r}, 'crashed-' + sys.argv[1])\n"
        "if not os.path.exists(marker):\n"
        "    open(marker, 'w').close()\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    assert functools.partial(device_check.gloo_collectives_problem, module="crashes_once")("cpu") is None
    assert sorted(p.name for p in tmp_path.glob("crashed-*")) == ["crashed-0", "crashed-1"]


def test_gloo_device_check_names_the_signal_and_the_stack(tmp_path, monkeypatch):
    problem = _crashing_device_check(tmp_path, monkeypatch)("cpu")
    assert "rank 0 died of SIGSEGV (signal 11)" in problem and "rank 1 died of SIGSEGV" in problem, problem
    assert "Fatal Python error: Segmentation fault" in problem, problem


@pytest.mark.parametrize("gpus", [1, 2])
def test_shared_gpu_selftest_refuses_or_moves_to_nccl_where_gloo_crashes(gpus, tmp_path, monkeypatch, capsys):
    """--device cuda --backend gloo on a torch whose gloo segfaults on CUDA tensors: NCCL when there is a GPU per
    rank, else a refusal naming the torch release and what to do; never a table of dead ranks."""
    import torch

    import shardadopt.selftest
    from shardadopt.selftest import device_check

    monkeypatch.setattr(device_check, "gloo_collectives_problem", _crashing_device_check(tmp_path, monkeypatch))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    backends = []
    monkeypatch.setattr(shardadopt.selftest, "run_selftest", lambda **kw: backends.append(kw["backend"]) or [])
    code = main(["selftest", "--device", "cuda", "--backend", "gloo", "--nproc", "2"])
    err = capsys.readouterr().err
    assert f"gloo collectives on CUDA tensors do not work with torch {torch.__version__}" in err, err
    assert "rank 0 died of SIGSEGV (signal 11)" in err, err
    if gpus == 1:
        assert code == 2 and backends == [], err
        assert "refused" in err and "run --backend nccl --nproc 1" in err, err
    else:
        assert code == 0 and backends == ["nccl"], err
        assert "running the scenarios on nccl instead (2 GPUs for 2 ranks)" in err, err
