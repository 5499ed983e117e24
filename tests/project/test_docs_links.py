"""The user documentation holds together: every relative link in ``README.md`` and ``docs/*.md`` reaches a file of
this checkout, every ``#anchor`` a heading of its target (as GitHub makes anchors from headings), and
``docs/patches.md`` has a section per registered patch. Text only: no network, no upstream imports.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

import shardadopt

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans, where brackets and ``#`` are not markdown."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but ``-`` and ``_`` removed, spaces to
    ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor ``path``'s headings define; repeated headings get ``-1``, ``-2``, ... as on GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    for match in HEADING.finditer(FENCE.sub("", path.read_text())):
        base = slug(match.group(2))
        found.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(prose(path.read_text())) if not EXTERNAL.match(m.group(1))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page: Path):
    broken = []
    for target in links(page):
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / unquote(file_part)).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and unquote(anchor) not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: broken links:\n" + "\n".join(broken)


def test_the_checker_sees_links_and_anchors_as_github_does():
    text = "[a](x.md#one) `[b](not-a-link.md)` ![img](p.png)\n```\n[c](in-code.md)\n# not a heading\n```\n"
    assert [m.group(1) for m in LINK.finditer(prose(text))] == ["x.md#one", "p.png"]
    assert slug("Custom loops: `shardadopt.hpo.optimize`") == "custom-loops-shardadopthpooptimize"
    assert slug("The \"needed on\" column") == "the-needed-on-column"
    assert slug("`transformers-ep-router-grad`") == "transformers-ep-router-grad"


def test_every_page_in_docs_is_reachable_from_the_readme_or_another_page():
    linked = {(page.parent / target.partition("#")[0]).resolve()
              for page in PAGES for target in links(page) if target.partition("#")[0]}
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages no page links to: {orphans}"


def test_patches_page_has_a_section_per_patch():
    sections = anchors(REPO / "docs" / "patches.md")
    missing = [p.id for p in shardadopt._registry().patches() if p.id not in sections]
    assert not missing, f"docs/patches.md has no `### `patch-id`` section (under its library's heading) for {missing}"
