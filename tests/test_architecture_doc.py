"""docs/architecture.md's file list is made from the tree: every module under src/dstrain, with the first sentence of
its docstring (the module's own words are the one home of what it is). A module added, moved or removed, or a
docstring's first sentence changed, fails here until ``python tests/test_architecture_doc.py`` writes the list anew."""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "dstrain"
DOC = ROOT / "docs" / "architecture.md"
FENCE = "```"
NAME_WIDTH = 34


def first_sentence(path: Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(docstring.split("\n\n")[0].split()).replace("``", "`")
    match = re.match(r"(.+?[.;])(\s|$)", paragraph)
    return (match.group(1) if match else paragraph).rstrip(".;")


def files_block() -> str:
    lines = ["src/dstrain/"]
    for path in sorted(SRC.rglob("*.py"), key=lambda p: p.relative_to(SRC).as_posix()):
        if path.name in ("__init__.py", "__main__.py"):  # the package's line is its folder's modules
            continue
        body = textwrap.wrap(first_sentence(path), 120 - NAME_WIDTH) or [""]
        lines.append(f"  {path.relative_to(SRC).as_posix():<{NAME_WIDTH - 2}}{body[0]}".rstrip())
        lines += [" " * NAME_WIDTH + line for line in body[1:]]
    return "\n".join(lines)


def documented_block(text: str) -> str:
    after = text.split("## Files", 1)[1]
    return after.split(FENCE)[1].strip("\n")


def test_the_file_list_is_the_tree():
    documented = documented_block(DOC.read_text(encoding="utf-8"))
    stale = "docs/architecture.md's Files block is stale: run python tests/test_architecture_doc.py"
    assert documented == files_block(), stale


def test_every_module_says_what_it_is():
    """A module without a docstring would be a bare name in the list."""
    modules = [p for p in SRC.rglob("*.py") if p.name != "__main__.py"]
    bare = [p.relative_to(SRC).as_posix() for p in modules if not first_sentence(p)]
    assert not bare


if __name__ == "__main__":
    text = DOC.read_text(encoding="utf-8")
    DOC.write_text(text.replace(documented_block(text), files_block()), encoding="utf-8")
    sys.exit(0)
