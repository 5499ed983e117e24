"""Record what every patch's probe says on each upstream release of the supported range.

For each (transformers, accelerate) pair below, install that pair into one scratch virtual environment (built once:
torch, this checkout editable), run ``shardadopt doctor --json`` from this checkout and keep each patch's state.
The result, ``tests/data/release_matrix.json``, is what the README's "needed on" column is checked against
(``tests/upstream/test_release_matrix.py``), and CI compares its own ``shardadopt.status()`` with the row of the
installed release, so the column cannot drift from the probes.

    python tools/release_matrix.py --venv /tmp/matrix-venv            # every release below
    python tools/release_matrix.py --venv /tmp/matrix-venv 5.18.0      # refresh some rows only
    python tools/release_matrix.py --readme                            # rewrite the README's "needed on" cells

Run it after changing a probe or the supported range; it takes about a minute per release.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "release_matrix.json"
README = REPO / "README.md"
# A row of the README's "What it fixes" table: | `patch-id` | what it fixes | needed on |
README_ROW = re.compile(r"^\| `(?P<id>[a-z0-9-]+)` \| (?P<fixes>.*) \| (?P<needed>[^|]*) \|$")

# Every transformers minor of the supported range (the newest patch release of each), with the accelerate release
# current when it came out; every accelerate minor of the range appears at least once. The peft release each row is
# recorded with: the oldest supported (0.21.2) on every transformers release, and the newest transformers once more
# with the newest tested peft (CI's newest set, .ci/constraints/newest.txt), which is the matrix's last row.
RELEASES: list[tuple[str, str, str]] = [
    ("5.15.0", "1.13.0", "0.21.2"), ("5.16.1", "1.14.0", "0.21.2"), ("5.17.0", "1.14.0", "0.21.2"),
    ("5.18.0", "1.14.0", "0.21.2"), ("5.19.0", "1.14.0", "0.21.2"), ("5.20.2", "1.15.0", "0.21.2"),
    ("5.21.0", "1.15.0", "0.21.2"), ("5.22.2", "1.15.0", "0.21.2"), ("5.23.0", "1.15.0", "0.21.2"),
    ("5.24.0", "1.15.0", "0.21.2"), ("5.25.0", "1.16.0", "0.21.2"), ("5.25.0", "1.16.0", "0.22.0"),
]

# The trl release every row is recorded with (the trl-* patches read trl, not transformers; 1.16 is the whole
# supported range).
TRL = "1.16.0"


def _run(*command: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=True, text=True, **kwargs)


def _ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        _run(sys.executable, "-m", "venv", str(venv))
        # torch first and pinned: the local CPU build; a range would let pip pull a CUDA build.
        _run(str(python), "-m", "pip", "install", "-q", "torch==2.13.0")
        _run(str(python), "-m", "pip", "install", "-q", "-e", str(REPO))
    # every time: a venv made before a pin was added (or changed) must not record that patch as unsupported
    _run(str(python), "-m", "pip", "install", "-q", f"trl=={TRL}")  # with its dependencies (datasets)
    return python


def row_key(row: dict) -> tuple[str, str]:
    """A matrix row's identity: its transformers and peft releases."""
    return row["transformers"], row["peft"]


def doctor(python: Path, transformers: str, accelerate: str, peft: str) -> dict:
    _run(str(python), "-m", "pip", "install", "-q", f"transformers=={transformers}", f"accelerate=={accelerate}")
    _run(str(python), "-m", "pip", "install", "-q", "--no-deps", f"peft=={peft}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([str(python), "-m", "shardadopt", "doctor", "--json"], capture_output=True, text=True,
                         env=env, cwd=REPO)
    try:
        report = json.loads(out.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"shardadopt doctor failed on transformers {transformers}:\n{out.stderr}") from None
    installed = {row["name"]: row["installed"] for row in report["versions"]}
    integrations = {row["name"]: row["installed"] for row in report["integrations"]}
    if (installed["transformers"], installed["accelerate"], integrations["peft"]) != (transformers, accelerate, peft):
        raise RuntimeError(f"asked for transformers {transformers} / accelerate {accelerate} / peft {peft}, doctor "
                           f"saw {installed}, peft {integrations['peft']}")
    return {"transformers": transformers, "accelerate": accelerate, "peft": peft, "trl": TRL,
            "torch": installed["torch"], "patches": {p["id"]: p["state"] for p in report["patches"]},
            "reasons": {p["id"]: p["reason"] for p in report["patches"]}}


def minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def needed_on(releases: list[dict], pid: str, distribution: str) -> str:
    """The README cell for ``pid``: the ``distribution`` releases (minor versions) on which its probe applies it."""
    states: dict[str, set[str]] = {}
    for row in releases:
        states.setdefault(minor(row[distribution]), set()).add(row["patches"][pid])
    mixed = {version: sorted(s) for version, s in states.items() if len(s) > 1}
    if mixed:
        raise ValueError(f"{pid}: on {distribution} {mixed} its state depends on another upstream too; the README "
                         f"column cannot name it by {distribution} release alone")
    order = sorted(states, key=lambda v: tuple(int(part) for part in v.split(".")))
    runs: list[list[str]] = []
    for index, version in enumerate(order):
        if states[version] == {"applied"}:
            if runs and order.index(runs[-1][-1]) == index - 1:
                runs[-1].append(version)
            else:
                runs.append([version])
    if not runs:
        return "none of the tested releases"
    return f"{distribution} " + ", ".join(run[0] if len(run) == 1 else f"{run[0]}–{run[-1]}" for run in runs)


def readme_cells(text: str) -> dict[str, str]:
    """patch id -> its "needed on" cell in the README."""
    return {m["id"]: m["needed"] for line in text.splitlines() if (m := README_ROW.match(line))}


def derived_cells() -> dict[str, str]:
    """patch id -> the "needed on" cell derived from the recorded matrix (each patch named by the upstream its probe
    reads: the first distribution of its ``requires``)."""
    sys.path.insert(0, str(REPO))
    from shardadopt.patches import process_registry

    releases = json.loads(DATA.read_text())["releases"]
    return {p.id: needed_on(releases, p.id, next(iter(p.requires))) for p in process_registry().patches()}


def write_readme() -> None:
    cells = derived_cells()

    def rewrite(line: str) -> str:
        m = README_ROW.match(line)
        return f"| `{m['id']}` | {m['fixes']} | {cells[m['id']]} |" if m and m["id"] in cells else line

    README.write_text("\n".join(rewrite(line) for line in README.read_text().split("\n")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, help="scratch virtual environment (created if missing)")
    parser.add_argument("--readme", action="store_true", help="only rewrite the README's needed-on cells")
    parser.add_argument("only", nargs="*", help="transformers releases to refresh (default: all; a release with "
                        "several peft rows refreshes each)")
    args = parser.parse_args(argv)
    if args.readme:
        write_readme()
        return 0
    if args.venv is None:
        parser.error("--venv is required to run the matrix")
    python = _ensure_venv(args.venv)
    rows = {row_key(r): r for r in json.loads(DATA.read_text())["releases"]} if DATA.exists() else {}
    ordered = [rows[(t, p)] for t, _, p in RELEASES if (t, p) in rows]
    for transformers, accelerate, peft in RELEASES:
        if args.only and transformers not in args.only:
            continue
        print(f"=== transformers {transformers}, accelerate {accelerate}, peft {peft}", flush=True)
        rows[(transformers, peft)] = doctor(python, transformers, accelerate, peft)
        for pid, state in rows[(transformers, peft)]["patches"].items():
            print(f"  {pid:<46} {state}")
        ordered = [rows[(t, p)] for t, _, p in RELEASES if (t, p) in rows]
        DATA.parent.mkdir(parents=True, exist_ok=True)  # written after each release: a long run keeps its progress
        DATA.write_text(json.dumps({"generated_by": "tools/release_matrix.py", "releases": ordered}, indent=1) + "\n")
    bad = [(row_key(r), pid) for r in ordered for pid, state in r["patches"].items()
           if state not in ("applied", "not-needed")]
    print(f"wrote {DATA.relative_to(REPO)}; " + (f"NOT DECIDED: {bad}" if bad else "every patch decided everywhere"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
