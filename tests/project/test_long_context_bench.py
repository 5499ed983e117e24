"""benchmarks/long_context.py --quick: every (cp, length) run measured its step time and step peak, each CP rank's
forward saw its share of the positions, not the whole sequence, and every step's global loss equals cp 1's (one
process on the whole sequence, computed in the same run) within fp32 tolerance."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "long_context.py"
LOSS_RTOL = 1e-4



def test_quick_mode_splits_the_sequence_and_matches_one_process(tmp_path):
    out_json = tmp_path / "runs.json"
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out_json)], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("OK"), out.stdout + out.stderr
    data = json.loads(out_json.read_text())
    runs = {(run["cp"], run["seq"]): run for run in data["runs"]}
    assert set(runs) == {(cp, seq) for cp in data["size"]["cps"] for seq in data["size"]["seqs"]}
    assert max(data["size"]["cps"]) >= 2
    for (cp, seq), run in runs.items():
        assert "error" not in run, run["error"]
        assert run["step_s"] > 0 and math.isfinite(run["peak_mib"]) and run["peak_mib"] >= 0, run
        assert len(run["losses"]) == data["size"]["steps"] and all(math.isfinite(x) for x in run["losses"])
        assert run["seen"] == [seq // cp], (cp, seq, run["seen"])  # cp > 1: fewer positions than the batch holds
        reference = runs[(1, seq)]["losses"]
        for got, want in zip(run["losses"], reference, strict=True):
            assert abs(got - want) <= LOSS_RTOL * abs(want), (cp, seq, run["losses"], reference)
    assert "cp 2 MiB" in out.stdout  # the table has a column per cp
