"""Every relative link in README.md and docs/*.md points at a file that exists, and every #anchor at a heading of
that file, named as GitHub names it (lower case, punctuation but `-` and `_` dropped, spaces to `-`, a repeated
heading numbered -1, -2, ...)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose(path: Path) -> list[str]:
    """The lines outside fenced code blocks, with inline code removed (neither holds links or headings)."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            lines.append(
                re.sub(r"`[^`]*`", lambda m: m.group(0).strip("`"), line)
                if line.startswith("#")
                else re.sub(r"`[^`]*`", "", line)
            )
    return lines


def github_slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in prose(path):
        if match := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = github_slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen[f"{slug}-{count}"] = 1
    return set(seen)


def test_github_slug_rules():
    assert github_slug("Parallelism: TP × PP × SP × DP = world size") == "parallelism-tp--pp--sp--dp--world-size"
    assert github_slug("Data pipeline — bench/bench_data.py") == "data-pipeline--benchbench_datapy"
    assert github_slug("Weight averaging (train.averaging)") == "weight-averaging-trainaveraging"


def test_a_repeated_heading_is_numbered(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A\n\n```\n# not a heading\n```\n\n## A\n\n### `code` B\n")
    assert anchors(page) == {"a", "a-1", "code-b"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for line in prose(page):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{target}: no file {path}")
            elif anchor and (path.suffix != ".md" or anchor not in anchors(path)):
                broken.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
