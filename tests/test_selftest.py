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
    assert " 0 failed" in out.stdout
    table = out.stdout.splitlines()
    assert table[0].startswith("shardadopt selftest:") and table[1].startswith("worker output: ")
    assert all(line.startswith(("PASS  ", "FAIL  ")) for line in table[2:-1]), out.stdout
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
    assert lines[-1] == "0 passed, 1 failed" and log.is_file()
    assert out.stderr == "", out.stderr


def test_selftest_rejects_unknown_scenario(capsys):
    assert main(["selftest", "--only", "no-such-scenario"]) == 2
    assert "known:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["selftest", "--device", "tpu"], ["frobnicate"]])
def test_cli_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
