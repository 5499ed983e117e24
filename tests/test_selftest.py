"""`shardadopt doctor` and `shardadopt selftest` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_selftest_cli_passes_on_two_cpu_ranks():
    """The real command, in a fresh process, as README's first line runs it."""
    out = subprocess.run([sys.executable, "-m", "shardadopt", "selftest", "--nproc", "2", "--timeout", "240"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS  fsdp-load-grads" in out.stdout
    assert " 0 failed" in out.stdout


def test_selftest_rejects_unknown_scenario(capsys):
    assert main(["selftest", "--only", "no-such-scenario"]) == 2
    assert "known:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["selftest", "--device", "tpu"], ["frobnicate"]])
def test_cli_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
