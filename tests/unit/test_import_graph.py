"""The import graph of the package, read with ``ast`` (nothing is imported): no cycles, and the
layering rules that keep each part usable on its own.

Every import statement counts, those inside functions too (a lazy import is still a
dependency). ``from x import y`` is an edge to ``x.y`` when that is a module, else to ``x``.
"""

import ast
from pathlib import Path

PACKAGE = "torchtitan_rl"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / PACKAGE


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    files = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    package = root.name
    graph = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    # Relative: level 1 is the current package (the module itself for an __init__).
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.add(submodule if submodule in files else base)
        graph[name] = {t for t in targets if (t == package or t.startswith(package + ".")) and t in files} - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def imports_under(graph: dict[str, set[str]], prefix: str) -> dict[str, set[str]]:
    return {name: targets for name, targets in graph.items() if name == prefix or name.startswith(prefix + ".")}


def test_no_import_cycles():
    cycle = find_cycle(import_graph(PACKAGE_DIR))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_distributed_depends_only_on_torch_and_compat():
    allowed = f"{PACKAGE}.distributed"
    for name, targets in imports_under(import_graph(PACKAGE_DIR), allowed).items():
        outside = {t for t in targets if t != allowed and not t.startswith(allowed + ".")} - {f"{PACKAGE}.compat"}
        assert not outside, f"{name} imports {sorted(outside)}"


def test_rl_imports_no_recipe():
    recipes = f"{PACKAGE}.recipes"
    for name, targets in imports_under(import_graph(PACKAGE_DIR), f"{PACKAGE}.rl").items():
        found = {t for t in targets if t == recipes or t.startswith(recipes + ".")}
        assert not found, f"{name} imports {sorted(found)}"


def test_graph_reader_on_a_small_package(tmp_path):
    """The reader itself: absolute, relative, submodule and function-level imports become edges."""
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "",
        "a.py": "import os\nfrom pkg.sub import b\n",
        "sub/__init__.py": "from . import c\n",
        "sub/b.py": "def f():\n    from ..a import f\n",  # lazy, relative: a <-> b
        "sub/c.py": "from pkg.sub.b import f\nimport pkg\n",
    }
    for path, text in sources.items():
        (root / path).write_text(text)
    graph = import_graph(root)
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.sub.b"},
        "pkg.sub": {"pkg.sub.c"},
        "pkg.sub.b": {"pkg.a"},
        "pkg.sub.c": {"pkg.sub.b", "pkg"},
    }
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    graph["pkg.sub.b"] = set()
    assert find_cycle(graph) is None
