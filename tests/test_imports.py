"""The package drawing, checked: no import circle between dstrain's modules (type-only and function-level imports
count too), and the floors hold: nothing below commands/ imports a command or plan/ (only commands use the cost model).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "dstrain"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every dstrain module ``path`` imports, wherever the import statement sits (module level, a function,
    ``if TYPE_CHECKING:``). ``from pkg import name`` counts as importing pkg.name when that is a module, else pkg."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import dstrain.a.b` of a module: itself; else its package
                target = target.rpartition(".")[0]
            if target and target != name and target != "dstrain":
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, set(known)) for name, path in known.items()}


def package_inits(name: str) -> set[str]:
    """A package's __init__ is not part of a circle through its own modules' imports of it (Python runs it first)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_walker_sees_every_kind_of_import(tmp_path):
    source = (
        "from __future__ import annotations\nfrom typing import TYPE_CHECKING\nimport dstrain.config\n"
        "from dstrain import errors\nfrom . import ranges\n"
        "if TYPE_CHECKING:\n    from dstrain.run_dir import RunDir\n"
        "def f():\n    from dstrain.data.manifest import read_manifest\n"
    )
    path = tmp_path / "dstrain" / "probe.py"
    path.parent.mkdir()
    path.write_text(source)
    known = {"dstrain.config", "dstrain.errors", "dstrain.ranges", "dstrain.run_dir", "dstrain.data.manifest"}
    assert imports_of("dstrain.probe", path, known) == known


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_in_dstrain():
    edges = graph()
    edges = {name: targets - package_inits(name) for name, targets in edges.items()}
    assert circles(edges) == []


def floor(name: str) -> str:
    return name.split(".")[1] if name.count(".") >= 1 else ""


@pytest.mark.parametrize("upper", ["commands", "plan"])
def test_nothing_below_commands_imports_commands_or_plan(upper):
    allowed = {"commands", upper, "cli", "__main__"}
    offenders = sorted(
        f"{name} imports {target}"
        for name, targets in graph().items()
        for target in targets
        if floor(target) == upper and floor(name) not in allowed
    )
    assert offenders == []
