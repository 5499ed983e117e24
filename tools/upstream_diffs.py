"""Build and check ``upstream-fixes/<id>.diff``: each patch's fix written as a change to upstream's own source.

A diff is a build artefact. Its source is ``upstream-fixes/fixes/<id_>.py`` (the id with ``-`` -> ``_``), which
defines ``FIX`` (a ``Fix``): exact-text ``Edit``s of upstream files, an upstream-style test (a ``NewFile`` in its
test folder), whether it is a backport of a released upstream fix or a proposal for upstream main, and a summary.
This script downloads the wheels of the releases on which the patch's probe applies it
(``tests/data/release_matrix.json``), applies the edits to a pristine copy of the oldest one and writes the unified
diff with the paths of upstream's repository (``tools/upstream_layout.py``: ``src/transformers/`` and ``tests/``,
pytorch's ``torch/`` and ``test/``, ...), so it applies with ``patch -p1`` at the top of an upstream clone.
``check`` holds every path to that layout and dry-runs each diff at the top of a tree laid out the same way, the
release's wheel at the repository's source folder.

    python tools/upstream_diffs.py build [ID ...]    # regenerate upstream-fixes/<id>.diff
    python tools/upstream_diffs.py check [ID ...]    # CI: every diff is what its fix generates, and applies
                                                     # (patch --dry-run -F0) to every release its probe applies to
    python tools/upstream_diffs.py verify ID --python VENV/bin/python [--release X]
                                                     # apply the diff to the release installed in VENV (or X) and
                                                     # run its test hunk: it must fail before and pass after

Where upstream moved the code inside a patch's range, a fix has several ``Variant``s (each from a release on);
each writes ``upstream-fixes/<id>@<release>.diff``, named after the oldest release it covers.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import ModuleType

from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
UPSTREAM_FIXES = REPO / "upstream-fixes"
FIXES = UPSTREAM_FIXES / "fixes"
MATRIX = REPO / "tests" / "data" / "release_matrix.json"
CACHE = Path(os.environ.get("SHARDADOPT_UPSTREAM_CACHE", Path.home() / ".cache" / "shardadopt-upstream"))
KINDS = ("backport", "proposal")


def _sibling(name: str) -> ModuleType:
    """``tools/<name>.py`` as the module ``name``, whether this script runs or is loaded by path (the tests)."""
    path = Path(__file__).with_name(f"{name}.py")
    if getattr(sys.modules.get(name), "__file__", None) != str(path):
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


_layout = _sibling("upstream_layout")
UPSTREAMS, layout_problems, source_hunks = _layout.UPSTREAMS, _layout.layout_problems, _layout.source_hunks


class FixError(RuntimeError):
    """A fix that does not build, or a diff that does not apply."""


# The header upstream's source and test files open with (transformers and accelerate alike).
LICENSE_HEADER = """\
# Copyright 2026 The HuggingFace Team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` (which must occur exactly ``count`` times) with ``new`` in ``path`` (under the package's
    folder in its upstream repository: ``src/transformers/...``, ``torch/...``)."""

    path: str
    old: str
    new: str
    count: int = 1


@dataclass(frozen=True)
class NewFile:
    """A file the fix adds, normally its test: ``path`` in upstream's repository layout (``tests/...``, pytorch's
    ``test/...``)."""

    path: str
    text: str


@dataclass(frozen=True)
class Variant:
    """The edits for the releases from ``since`` on (until the next variant's ``since``)."""

    since: str
    edits: tuple[Edit, ...]
    new_files: tuple[NewFile, ...] = ()


@dataclass(frozen=True)
class Fix:
    """One patch's fix as a change to upstream's source.

    ``kind`` is ``backport`` (``upstream`` names the released fix: PR and release) or ``proposal`` (``upstream``
    names where it should go: upstream main, the issue if reported). ``summary`` says what is wrong and what the
    change does, in a maintainer's words. ``edits``/``new_files`` make a fix with one variant.
    """

    id: str
    distribution: str
    kind: str
    upstream: str
    summary: str
    edits: tuple[Edit, ...] = ()
    new_files: tuple[NewFile, ...] = ()
    variants: tuple[Variant, ...] = field(default=())

    def all_variants(self) -> tuple[Variant, ...]:
        if self.variants and (self.edits or self.new_files):
            raise FixError(f"{self.id}: give either edits/new_files or variants, not both")
        return self.variants or (Variant(since="0", edits=self.edits, new_files=self.new_files),)


def load_fix(path: Path) -> Fix:
    sys.modules.setdefault("upstream_diffs", sys.modules[__name__])  # fixes import the dataclasses from here
    spec = importlib.util.spec_from_file_location(f"fix_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fix = getattr(module, "FIX", None)
    if not isinstance(fix, Fix):
        raise FixError(f"{path} defines no FIX = Fix(...)")
    if path.stem != fix.id.replace("-", "_"):
        raise FixError(f"{path}: file name and FIX.id {fix.id!r} disagree")
    if fix.kind not in KINDS or fix.distribution not in UPSTREAMS:
        raise FixError(f"{fix.id}: kind must be one of {KINDS}, distribution one of {sorted(UPSTREAMS)}")
    return fix


def load_fixes(only: list[str] | None = None) -> dict[str, Fix]:
    fixes = {fix.id: fix for fix in map(load_fix, sorted(FIXES.glob("*.py")))}
    unknown = set(only or ()) - set(fixes)
    if unknown:
        raise FixError(f"no fix in {FIXES.relative_to(REPO)} for {sorted(unknown)}")
    return {pid: fix for pid, fix in fixes.items() if not only or pid in only}


def applied_releases(fix: Fix) -> list[str]:
    """The releases of ``fix.distribution`` on which the patch's probe applies it (the recorded release matrix)."""
    rows = json.loads(MATRIX.read_text())["releases"]
    if not any(fix.id in row["patches"] for row in rows):
        raise FixError(f"{fix.id}: not in {MATRIX.relative_to(REPO)}; run tools/release_matrix.py")
    versions = {row[fix.distribution] for row in rows if row["patches"].get(fix.id) == "applied"}
    return sorted(versions, key=Version)


def coverage(fix: Fix) -> list[tuple[Variant, list[str]]]:
    """Each variant with the applied releases it covers; every applied release is covered by exactly one. A variant
    for releases newer than every recorded one (torch: the matrix records one torch release) has nothing to diff
    against yet and is left out."""
    releases = applied_releases(fix)
    if not releases:
        raise FixError(f"{fix.id}: its probe applies it on no recorded release; nothing to diff against")
    variants = sorted((v for v in fix.all_variants() if Version(v.since) <= Version(releases[-1])),
                      key=lambda v: Version(v.since))
    covered = []
    for index, variant in enumerate(variants):
        upper = variants[index + 1].since if index + 1 < len(variants) else None
        mine = [r for r in releases if Version(r) >= Version(variant.since)
                and (upper is None or Version(r) < Version(upper))]
        if not mine:
            raise FixError(f"{fix.id}: variant since {variant.since} covers none of {releases}")
        covered.append((variant, mine))
    if Version(releases[0]) < Version(variants[0].since):
        raise FixError(f"{fix.id}: release {releases[0]} is older than every variant")
    return covered


def diff_for(fix: Fix, version: str) -> Path:
    """The committed diff meant for ``version`` of ``fix.distribution``: the newest variant from ``version`` back."""
    chosen = [(variant, releases) for variant, releases in coverage(fix)
              if Version(variant.since) <= Version(version)]
    if not chosen:
        raise FixError(f"{fix.id}: no variant for {fix.distribution} {version}")
    return diff_path(fix, chosen[-1][1])


def diff_path(fix: Fix, releases: list[str]) -> Path:
    return UPSTREAM_FIXES / (f"{fix.id}.diff" if len(fix.all_variants()) == 1 else f"{fix.id}@{releases[0]}.diff")


def committed_diffs(fix: Fix) -> list[Path]:
    """The diffs of ``fix`` in ``upstream-fixes/``: ``<id>.diff`` and ``<id>@<release>.diff``."""
    return [p for p in UPSTREAM_FIXES.glob(f"{fix.id}*.diff") if p.name == f"{fix.id}.diff" or
    p.name.startswith(f"{fix.id}@")]


def fetch(distribution: str, version: str) -> Path:
    """A pristine tree of ``distribution==version`` laid out like its upstream repository: the published wheel's
    ``<package>/`` at the repository's source folder (``src/transformers/``, ``torch/``); no test folder."""
    upstream = UPSTREAMS[distribution]
    root = CACHE / f"{distribution}-{version}"
    if (root / upstream.source).is_dir():
        return root
    if root.exists():  # unpacked in another layout (before the layout of this repository was known)
        shutil.rmtree(root)
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"{distribution}-{version}-*.whl"))  # torch's wheels are per platform
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "-d", str(wheels), f"{distribution}=={version}"], check=True)
        found = sorted(wheels.glob(f"{distribution}-{version}-*.whl"))
    name = found[0].name
    staging = Path(tempfile.mkdtemp(dir=CACHE))
    with zipfile.ZipFile(wheels / name) as wheel:
        members = [m for m in wheel.namelist() if m.startswith(upstream.package + "/")]
        wheel.extractall(staging / PurePosixPath(upstream.source).parent, members)
    if root.exists():  # another process unpacked it meanwhile
        shutil.rmtree(staging)
    else:
        staging.rename(root)
    return root


def apply_edits(fix: Fix, variant: Variant, tree: Path, version: str) -> dict[str, tuple[str, str]]:
    """path -> (pristine text, changed text) for every file the variant touches."""
    files: dict[str, tuple[str, str]] = {}
    upstream = UPSTREAMS[fix.distribution]
    for edit in variant.edits:
        if upstream.part(edit.path) != "source":
            raise FixError(f"{fix.id}: edit path {edit.path!r} is not under {upstream.source}/, the source folder in "
                           f"{upstream.layout()}")
        pristine, text = files.get(edit.path) or ((tree / edit.path).read_text(),) * 2
        found = text.count(edit.old)
        if found != edit.count:
            first = edit.old.strip().splitlines()[0] if edit.old.strip() else "<empty>"
            raise FixError(f"{fix.id} on {fix.distribution} {version}: {edit.path}: expected {edit.count} "
                           f"occurrence(s) of the text starting {first!r}, found {found}")
        files[edit.path] = (pristine, text.replace(edit.old, edit.new))
    for new in variant.new_files:
        if upstream.part(new.path) is None:
            raise FixError(f"{fix.id}: new file {new.path!r} is outside {upstream.layout()}")
        if (tree / new.path).exists():
            raise FixError(f"{fix.id}: {new.path} already exists upstream")
        files[new.path] = ("", new.text)
    return files


def _header(fix: Fix, releases: list[str]) -> str:
    span = releases[0] if len(releases) == 1 else f"{releases[0]} .. {releases[-1]}"
    kind = (f"backport of {fix.upstream}" if fix.kind == "backport" else f"proposal for {fix.upstream}")
    upstream = UPSTREAMS[fix.distribution]
    lines = [f"shardadopt patch {fix.id}: {kind}",
             f"Applies to: {fix.distribution} {span} (every release on which its probe applies the patch).",
             f"Paths as in {upstream.repository}: source under {upstream.source}/, tests under {upstream.tests}/.",
             "Checked with `patch -p1 --dry-run -F0` in a tree laid out that way from each release's wheel.",
             f"Generated by tools/upstream_diffs.py from upstream-fixes/fixes/{fix.id.replace('-', '_')}.py; "
             "do not edit.",
             ""]
    for paragraph in textwrap.dedent(fix.summary).strip().split("\n\n"):
        lines += textwrap.wrap(" ".join(paragraph.split()), 116, break_on_hyphens=False) + [""]
    if any(line.startswith(("---", "+++", "diff ", "Index:", "@@", "*** ")) for line in lines):
        raise FixError(f"{fix.id}: a summary line would read as a diff header to patch")
    return "\n".join(lines) + "\n"


def render(fix: Fix, variant: Variant, releases: list[str]) -> str:
    tree = fetch(fix.distribution, releases[0])
    files = apply_edits(fix, variant, tree, releases[0])
    new_paths = {new.path for new in variant.new_files}
    part = UPSTREAMS[fix.distribution].part
    if not any(before != after for path, (before, after) in files.items() if part(path) == "source"):
        raise FixError(f"{fix.id}: the fix changes nothing in upstream's source")
    body = []
    for path in sorted(files, key=lambda p: (part(p) == "tests", p)):
        before, after = files[path]
        body += difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                     "/dev/null" if path in new_paths else f"a/{path}", f"b/{path}")
    if not any(part(p) == "tests" for p in files):
        raise FixError(f"{fix.id}: the fix has no test hunk (a NewFile under {UPSTREAMS[fix.distribution].tests}/)")
    return _header(fix, releases) + "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                                            for line in body)


def dry_run(diff: str, tree: Path, strip: int = 1) -> subprocess.CompletedProcess:
    """``patch --dry-run`` with no fuzz and no reversed-patch guessing: does ``diff`` apply exactly in ``tree``?"""
    return subprocess.run(["patch", f"-p{strip}", "--dry-run", "-F0", "-N", "-s", "-d", str(tree)], input=diff,
                          capture_output=True, text=True)


def build(fixes: dict[str, Fix]) -> None:
    for fix in fixes.values():
        # everything rendered before anything is replaced: a fix that no longer builds leaves its diffs as they were
        rendered = {diff_path(fix, releases): (render(fix, variant, releases), releases)
                    for variant, releases in coverage(fix)}
        for old in committed_diffs(fix):
            old.unlink()
        for path, (text, releases) in rendered.items():
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)} ({fix.distribution} {releases[0]} .. {releases[-1]})")


def check(fixes: dict[str, Fix]) -> list[str]:
    problems = []
    for fix in fixes.values():
        expected = set()
        for variant, releases in coverage(fix):
            path = diff_path(fix, releases)
            expected.add(path.name)
            if not path.exists():
                problems.append(f"{path.relative_to(REPO)} is missing: run tools/upstream_diffs.py build {fix.id}")
                continue
            committed = path.read_text()
            problems += [f"{path.name}: {problem}" for problem in layout_problems(committed, fix.distribution)]
            try:
                if committed != render(fix, variant, releases):
                    problems.append(f"{path.relative_to(REPO)} differs from what upstream-fixes/fixes generates: "
                                    f"run tools/upstream_diffs.py build {fix.id}")
            except FixError as error:
                problems.append(str(error))
            for release in releases:
                result = dry_run(committed, fetch(fix.distribution, release))
                status = "applies" if result.returncode == 0 else "DOES NOT APPLY"
                print(f"{path.name:<56} {fix.distribution} {release:<8} {status}")
                if result.returncode:
                    problems.append(f"{path.name} does not apply to {fix.distribution} {release}:\n"
                                    f"{result.stdout}{result.stderr}")
        stray = {p.name for p in committed_diffs(fix)} - expected
        problems += [f"upstream-fixes/{name} is not generated by its fix any more: delete it" for name in sorted(stray)]
    return problems


def verify(fix: Fix, python: str, release: str | None = None) -> list[str]:
    """Run the fix's test hunk with ``python`` against ``release`` (default: the one installed for ``python``; another
    one goes first on ``PYTHONPATH``, over the installed one): it must fail pristine and pass patched."""
    installed = release or subprocess.run(
        [python, "-c", f"import importlib.metadata as m; print(m.version({fix.distribution!r}))"],
        capture_output=True, text=True, check=True).stdout.strip()
    chosen = next(((v, r) for v, r in coverage(fix) if installed in r), None)
    if chosen is None:
        return [f"{fix.id}: {fix.distribution} {installed} is not a release its probe applies it on"]
    variant, releases = chosen
    problems = []
    upstream = UPSTREAMS[fix.distribution]
    with tempfile.TemporaryDirectory() as work:
        upstream_tree = fetch(fix.distribution, installed)
        trees = {label: Path(work) / label for label in ("pristine", "patched")}
        for tree in trees.values():
            shutil.copytree(upstream_tree, tree)
        diff = diff_path(fix, releases)
        subprocess.run(["patch", "-p1", "-F0", "-s", "-d", str(trees["patched"]), "-i", str(diff)], check=True)
        tests = [new.path for new in variant.new_files]
        for new in variant.new_files:  # the pristine run needs the test file too
            (trees["pristine"] / new.path).parent.mkdir(parents=True, exist_ok=True)
            (trees["pristine"] / new.path).write_text(new.text)
        for label, want_pass in (("pristine", False), ("patched", True)):
            env = {**os.environ, "PYTHONPATH": str(trees[label] / PurePosixPath(upstream.source).parent)}
            result = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                                    cwd=trees[label], env=env, capture_output=True, text=True)
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-3:])
            print(f"{fix.id} on {fix.distribution} {installed}, {label}: rc={result.returncode}\n  {tail}")
            if (result.returncode == 0) != want_pass:
                problems.append(f"{fix.id}: its test {'fails' if want_pass else 'passes'} on the {label} "
                                f"{fix.distribution} {installed}:\n{result.stdout[-3000:]}{result.stderr[-2000:]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("build", "check", "verify"))
    parser.add_argument("ids", nargs="*", help="patch ids (default: every fix in upstream-fixes/fixes)")
    parser.add_argument("--python", help="verify: the interpreter of a venv with the upstream release installed")
    parser.add_argument("--release", help="verify: the upstream release to test (default: the installed one)")
    args = parser.parse_args(argv)
    try:
        fixes = load_fixes(args.ids)
        if args.command == "build":
            build(fixes)
            return 0
        if args.command == "check":
            problems = check(fixes)
        else:
            if not args.python:
                parser.error("verify needs --python")
            problems = [p for fix in fixes.values() for p in verify(fix, args.python, args.release)]
    except FixError as error:
        problems = [str(error)]
    for problem in problems:
        print(f"ERROR: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
