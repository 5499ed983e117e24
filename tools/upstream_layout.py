"""Where each upstream repository keeps its package and its tests, and which of a unified diff's paths fall where.

``upstream-fixes/*.diff`` are written for upstream's repositories, so their paths are the repositories' own:
transformers,
accelerate and peft keep ``src/<package>/`` and ``tests/``, trl keeps ``trl/`` and ``tests/``, pytorch keeps
``torch/`` and ``test/``. ``tools/upstream_diffs.py`` builds its trees, places its edits and checks its diffs by this
table (``UPSTREAMS``); a new upstream is a new row, not a new case in the code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath


@dataclass(frozen=True)
class Upstream:
    """Where a distribution's package and tests sit in its upstream repository (paths from the repository's top)."""

    repository: str
    package: str
    source: str  # the package's folder (ends in ``package``): a wheel's ``<package>/`` goes there
    tests: str  # the test folder: a fix's upstream-style test is a new file under it

    def part(self, path: str) -> str | None:
        """``"source"`` or ``"tests"`` for a path under the source folder or the test folder, else None."""
        return next((name for name, top in (("source", self.source), ("tests", self.tests))
                     if path.startswith(f"{top}/")), None)

    def layout(self) -> str:
        """The layout in words, for error messages."""
        return f"{self.repository}'s layout (source under {self.source}/, tests under {self.tests}/)"

    def site_packages_strip(self) -> int:
        """The ``patch -p`` that applies a diff's source hunks in the site-packages holding the installed package."""
        return len(PurePosixPath(self.source).parts)


UPSTREAMS = {up.package: up for up in (  # keyed by distribution: each one's name is its package's
    Upstream("huggingface/transformers", "transformers", "src/transformers", "tests"),
    Upstream("huggingface/accelerate", "accelerate", "src/accelerate", "tests"),
    Upstream("huggingface/peft", "peft", "src/peft", "tests"),
    Upstream("huggingface/trl", "trl", "trl", "tests"),
    Upstream("pytorch/pytorch", "torch", "torch", "test"),
)}

_HUNK = re.compile(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def file_sections(diff: str) -> list[tuple[str, str, str]]:
    """Each file of a unified diff as (``---`` name, ``+++`` name, its text from ``---`` on), read hunk by hunk by
    their line counts (a removed line that starts with ``--`` is not a file); the header before is left out."""
    lines, found, i = diff.splitlines(keepends=True), [], 0
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        start, i = i, i + 2
        while i < len(lines) and (match := _HUNK.match(lines[i])):
            old, new, i = int(match[1] or 1), int(match[2] or 1), i + 1
            # a truncated hunk ends with the text; `patch` names it when the diff is dry-run
            while i < len(lines) and (old > 0 or new > 0 or lines[i].startswith("\\")):
                line, i = lines[i], i + 1
                old -= not line.startswith(("+", "\\"))
                new -= not line.startswith(("-", "\\"))
        old_name, new_name = (lines[start + n][4:].rstrip("\n").split("\t")[0] for n in (0, 1))
        found.append((old_name, new_name, "".join(lines[start:i])))
    return found


def layout_problems(diff: str, distribution: str) -> list[str]:
    """What in ``diff`` is outside the layout of ``distribution``'s upstream repository.

    Args:
        diff: a unified diff (a header before the first file is allowed).
        distribution: a key of ``UPSTREAMS``.

    Returns:
        One line per problem: each file's path as ``patch -p1`` reads it (``a/PATH``, ``b/PATH``, ``/dev/null`` for
        a new file) must be under the source folder or the test folder; empty when the diff is in the layout.
    """
    upstream, sections, problems = UPSTREAMS[distribution], file_sections(diff), []
    for old, new, _text in sections:
        paths = {name.partition("/")[2] for name in (old, new) if name != "/dev/null"}
        if len(paths) != 1:
            problems.append(f"--- {old} and +++ {new} do not name one file")
        problems += [f"{path} is outside {upstream.layout()}" for path in sorted(paths) if not upstream.part(path)]
    return problems if sections else ["the diff changes no file"]


def source_hunks(diff: str) -> str:
    """The files of ``diff`` under an upstream's source folder (without its header and its test files)."""
    return "".join(text for _old, new, text in file_sections(diff)
                   if any(up.part(new.partition("/")[2]) == "source" for up in UPSTREAMS.values()))
