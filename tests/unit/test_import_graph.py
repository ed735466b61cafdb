"""The import graph of the package, read with ``ast`` (nothing is imported): no cycles, and the
layering that keeps each part usable on its own.

Every import statement counts, those inside functions too (a lazy import is still a
dependency). ``from x import y`` is an edge to ``x.y`` when that is a module, else to ``x``.
"""

import ast
from pathlib import Path

PACKAGE = "torchtitan_rl"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / PACKAGE

# Module prefix -> layer. A module imports modules of its own part (its longest prefix here) and
# of lower layers only; parts on the same layer are independent of each other. Every module of
# the package falls under one prefix, so a new top-level module must be placed here.
LAYERS = {
    PACKAGE: 0,  # the package's __init__: empty
    f"{PACKAGE}.compat": 0,  # the torch-version differences
    # The keys, their types, ranges and the rules on their values: a run's config is parsed and
    # checked without torch or any part of the package.
    f"{PACKAGE}.config": 1,
    f"{PACKAGE}.tensorboard_io": 1,  # reads logged scalars back (scripts, tests)
    f"{PACKAGE}.rollout_files": 1,  # the rollout and evaluation dumps' files: written, read (no torch)
    f"{PACKAGE}.distributed": 2,  # torch.distributed building blocks
    f"{PACKAGE}.rollout_viewer": 2,  # scripts/show_rollouts.py's tables and page (no torch)
    f"{PACKAGE}.optim": 2,  # AdamW and the schedule, over plain and DTensor parameters
    f"{PACKAGE}.data": 3,
    f"{PACKAGE}.models": 3,
    f"{PACKAGE}.profiling": 3,  # memory snapshots: the [profiling] section and the mesh
    f"{PACKAGE}.losses": 4,
    # Memory estimates of a layout, from the model built on meta (``train.py --estimate``).
    f"{PACKAGE}.estimate": 4,
    f"{PACKAGE}.hf_tokenizer_files": 4,  # what an export writes of the tokenizer (data's tokenizers)
    f"{PACKAGE}.engine": 5,
    f"{PACKAGE}.rl": 5,
    f"{PACKAGE}.metrics": 5,  # global reductions of the losses' and router's step results
    # Checkpoints: HF files of a model, a PEFT adapter on top of them, DCP runs that export both.
    f"{PACKAGE}.hf_checkpoint": 5,
    f"{PACKAGE}.peft_checkpoint": 6,
    f"{PACKAGE}.engine_scores": 6,  # a reward model's engine, built on the engine's packing and passes
    f"{PACKAGE}.engine_pipeline": 6,  # the engine through pipeline stages
    f"{PACKAGE}.engine_values": 7,  # a critic's engine: the reward model's, read at every token
    f"{PACKAGE}.checkpoint": 7,
    # The Tinker-compatible service: its HTTP layer, the dispatch of operations, the clients.
    f"{PACKAGE}.service": 8,
    f"{PACKAGE}.recipes": 9,  # builds and runs everything; the rules on a config that need its parts
}


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


def part_of(name: str, layers: dict[str, int]) -> str | None:
    """The longest prefix of ``layers`` that ``name`` falls under, or None."""
    prefixes = [p for p in layers if name == p or name.startswith(p + ".")]
    return max(prefixes, key=len, default=None)


def layer_violations(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Modules without a layer, and every import of a module of the same or a higher layer
    than the importer's that is not of the importer's own part."""
    problems = [f"{name} has no layer" for name in sorted(graph) if part_of(name, layers) is None]
    for name, targets in sorted(graph.items()):
        source = part_of(name, layers)
        for target in sorted(targets):
            part = part_of(target, layers)
            if None not in (source, part) and part != source and layers[part] >= layers[source]:
                problems.append(f"{name} (layer {layers[source]}) imports {target} (layer {layers[part]})")
    return problems


def test_layers():
    problems = layer_violations(import_graph(PACKAGE_DIR), LAYERS)
    assert not problems, "\n".join(problems)


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
    # Layers: a (1) over sub (0) allows a -> sub.b only; sub.c -> pkg is an import of the
    # package's own part (the longest prefix of pkg.sub.c is pkg.sub, a different part).
    layers = {"pkg": 0, "pkg.a": 1, "pkg.sub": 0}
    assert layer_violations(graph, layers) == [
        "pkg.sub.b (layer 0) imports pkg.a (layer 1)",
        "pkg.sub.c (layer 0) imports pkg (layer 0)",
    ]
    assert layer_violations(graph, {"pkg.a": 1}) == [
        "pkg has no layer",
        "pkg.sub has no layer",
        "pkg.sub.b has no layer",
        "pkg.sub.c has no layer",
    ]
    graph["pkg.sub.b"] = set()
    assert find_cycle(graph) is None
    assert layer_violations(graph, {"pkg": 0, "pkg.a": 1, "pkg.sub": 2}) == [
        "pkg.a (layer 1) imports pkg.sub.b (layer 2)"
    ]
