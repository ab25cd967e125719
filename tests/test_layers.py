"""The package's layers show: no import cycle between kvcanary's modules and no import from a
lower layer into a higher one (function-level imports included). A new module gets a layer
here; an arrow that breaks the order fails with the importing module and the imported one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvcanary"

# Lowest first. A module may import its own layer and the ones below it.
LAYERS = [
    ("format", ["format"]),
    ("system", ["system"]),
    ("model", ["model"]),
    ("backends", ["backends"]),
    ("api", ["api"]),
    ("findings", ["findings"]),
    ("dump", ["dump"]),
    ("audit", ["audit"]),
    ("report", ["report"]),
    ("synth", ["synth"]),
    ("campaign", ["campaign"]),
    ("integrations", ["integrations"]),
    ("tools", ["tools"]),
    ("cli", ["cli", "__main__", "__init__"]),
]
LAYER_OF = {top: index for index, (_, tops) in enumerate(LAYERS) for top in tops}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set:
    """kvcanary modules a file imports (absolute names, relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvcanary"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("kvcanary"):
                if node.module:        # ``from . import x`` imports x, not the package
                    found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)
    return found


def graph() -> dict:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {t for t in imports(path) if t in files and t != name}
            for name, path in files.items()}


def layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    assert top in LAYER_OF, f"{module}: give it a layer in tests/test_layers.py"
    return LAYER_OF[top]


def test_no_upward_import():
    upward = sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets
                    if layer(b) > layer(a))
    assert not upward, upward


def test_no_import_cycle():
    edges = graph()
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    # A package's __init__ re-exporting its own submodules is not a cycle of the layers.
    cycles = [c for c in cycles if not _package_reexport(c)]
    assert not cycles, cycles


def _package_reexport(cycle: str) -> bool:
    nodes = cycle.split(" -> ")
    return any(b.startswith(a + ".") for a, b in zip(nodes, nodes[1:]))


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    fake = tmp_path / "kvcanary"
    (fake / "synth").mkdir(parents=True)
    (fake / "format").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "format" / "__init__.py").write_text("")
    (fake / "format" / "consts.py").write_text("from ..campaign import x\n")
    (fake / "campaign.py").write_text("from .format import consts\n")
    (fake / "synth" / "__init__.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    edges = graph()
    assert "kvcanary.campaign" in edges["kvcanary.format.consts"]
    assert layer("kvcanary.campaign") > layer("kvcanary.format.consts")
    assert "kvcanary.format.consts" in edges["kvcanary.campaign"]
