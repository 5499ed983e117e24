"""Record what every patch's probe says on each upstream release of the supported range.

For each (transformers, accelerate) pair below, install that pair into one scratch virtual environment (built once:
torch, this checkout editable), run ``shardadopt doctor --json`` from this checkout and keep each patch's state.
The result, ``tests/data/release_matrix.json``, is what the README's "needed on" column is checked against
(``tests/test_release_matrix.py``), and CI compares its own ``shardadopt.status()`` with the row of the installed
release, so the column cannot drift from the probes.

    python tools/release_matrix.py --venv /tmp/matrix-venv            # every release below
    python tools/release_matrix.py --venv /tmp/matrix-venv 5.18.0      # refresh some rows only

Run it after changing a probe or the supported range; it takes about a minute per release.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "release_matrix.json"

# Every transformers minor of the supported range (the newest patch release of each), with the accelerate release
# current when it came out; every accelerate minor of the range appears at least once.
RELEASES: list[tuple[str, str]] = [
    ("5.15.0", "1.13.0"), ("5.16.1", "1.14.0"), ("5.17.0", "1.14.0"), ("5.18.0", "1.14.0"), ("5.19.0", "1.14.0"),
    ("5.20.2", "1.15.0"), ("5.21.0", "1.15.0"), ("5.22.2", "1.15.0"), ("5.23.0", "1.15.0"), ("5.24.0", "1.15.0"),
]


def _run(*command: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=True, text=True, **kwargs)


def _ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        _run(sys.executable, "-m", "venv", str(venv))
        # torch first and pinned: the local CPU build; a range would let pip pull a CUDA build.
        _run(str(python), "-m", "pip", "install", "-q", "torch==2.13.0")
        _run(str(python), "-m", "pip", "install", "-q", "-e", str(REPO))
    return python


def doctor(python: Path, transformers: str, accelerate: str) -> dict:
    _run(str(python), "-m", "pip", "install", "-q", f"transformers=={transformers}", f"accelerate=={accelerate}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([str(python), "-m", "shardadopt", "doctor", "--json"], capture_output=True, text=True,
                         env=env, cwd=REPO)
    report = json.loads(out.stdout)
    installed = {row["name"]: row["installed"] for row in report["versions"]}
    if (installed["transformers"], installed["accelerate"]) != (transformers, accelerate):
        raise RuntimeError(f"asked for transformers {transformers} / accelerate {accelerate}, doctor saw {installed}")
    return {"transformers": transformers, "accelerate": accelerate, "torch": installed["torch"],
            "patches": {p["id"]: p["state"] for p in report["patches"]},
            "reasons": {p["id"]: p["reason"] for p in report["patches"]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, required=True, help="scratch virtual environment (created if missing)")
    parser.add_argument("only", nargs="*", help="transformers releases to refresh (default: all)")
    args = parser.parse_args(argv)
    python = _ensure_venv(args.venv)
    rows = {r["transformers"]: r for r in json.loads(DATA.read_text())["releases"]} if DATA.exists() else {}
    for transformers, accelerate in RELEASES:
        if args.only and transformers not in args.only:
            continue
        print(f"=== transformers {transformers}, accelerate {accelerate}", flush=True)
        rows[transformers] = doctor(python, transformers, accelerate)
        for pid, state in rows[transformers]["patches"].items():
            print(f"  {pid:<46} {state}")
    ordered = [rows[t] for t, _ in RELEASES if t in rows]
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps({"generated_by": "tools/release_matrix.py", "releases": ordered}, indent=1) + "\n")
    bad = [(r["transformers"], pid) for r in ordered for pid, state in r["patches"].items()
           if state not in ("applied", "not-needed")]
    print(f"wrote {DATA.relative_to(REPO)}; " + (f"NOT DECIDED: {bad}" if bad else "every patch decided everywhere"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
