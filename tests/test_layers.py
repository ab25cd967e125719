"""The package's layers show, and the folders are the layers: each folder of kvcanary/ says in
its README.md what lives there and which folders it may import (a ``May import:`` line); the
test reads the layers from those lines. It fails on an import a folder does not declare
(function-level imports included), on declarations that are not a strict order of layers, on
an import cycle between modules, and on a module outside the folders (the top level holds
only the package's ``__init__`` and ``__main__``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvcanary"
# What a README's May-import line names besides folders: the package's public API.
PUBLIC = "kvcanary"
TOP_LEVEL = {"__init__.py", "__main__.py"}


def folders() -> list:
    return sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


def declared() -> dict:
    """folder -> the set of folders (and ``kvcanary``) its README says it may import."""
    may = {}
    for folder in folders():
        readme = PACKAGE / folder / "README.md"
        assert readme.is_file(), f"kvcanary/{folder}: say in a README.md what lives there " \
                                 "and what it may import"
        found = re.findall(r"^May import: *(.*)$", readme.read_text(encoding="utf-8"), re.M)
        assert len(found) == 1, f"{readme}: one 'May import:' line (folders, or 'nothing')"
        names = {n.strip() for n in found[0].split(",") if n.strip()} - {"nothing"}
        unknown = names - set(folders()) - {PUBLIC}
        assert not unknown, f"{readme}: no such folder: {sorted(unknown)}"
        may[folder] = names
    return may


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


def folder_of(module: str) -> str | None:
    """The folder a module lives in; None for the package's top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else None


def undeclared(edges: dict, may: dict) -> list:
    found = []
    for a, targets in edges.items():
        source = folder_of(a)
        if source is None:        # kvcanary/__init__ and __main__: the package itself
            continue
        for b in targets:
            target = folder_of(b) or PUBLIC
            if target != source and target not in may[source]:
                found.append(f"{a} -> {b} (kvcanary/{source}/README.md does not declare {target})")
    return sorted(found)


def not_layered(may: dict) -> list:
    """Declarations that are not a strict order: a folder that may import itself through
    another, or that does not also declare what the folders it imports may import."""
    found = []
    for folder, names in may.items():
        for lower in names - {PUBLIC}:
            if folder in may[lower]:
                found.append(f"{folder} and {lower} may import each other")
            missing = may[lower] - names
            if missing:
                found.append(f"{folder} may import {lower} but not what {lower} may: "
                             f"{sorted(missing)}")
    return sorted(found)


def test_every_module_lives_in_a_folder():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in TOP_LEVEL)
    assert not loose, f"modules outside the folders: {loose}"


def test_the_folders_are_a_strict_order_of_layers():
    assert not_layered(declared()) == []


def test_no_import_a_folder_does_not_declare():
    assert undeclared(graph(), declared()) == []


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


def test_the_checker_sees_an_undeclared_import_a_cycle_and_a_loose_module(tmp_path,
                                                                          monkeypatch):
    fake = tmp_path / "kvcanary"
    for folder, may in (("format", "nothing"), ("campaign", "format")):
        (fake / folder).mkdir(parents=True)
        (fake / folder / "__init__.py").write_text("")
        (fake / folder / "README.md").write_text(f"# {folder}\n\nMay import: {may}\n")
    (fake / "__init__.py").write_text("")
    (fake / "format" / "consts.py").write_text("from ..campaign import x\n")
    (fake / "campaign" / "x.py").write_text("from ..format import consts\n")
    (fake / "loose.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    edges = graph()
    assert "kvcanary.campaign.x" in edges["kvcanary.format.consts"]
    assert undeclared(edges, declared()) == [
        f"kvcanary.format.consts -> {target} "
        "(kvcanary/format/README.md does not declare campaign)"
        for target in ("kvcanary.campaign", "kvcanary.campaign.x")]
    assert "kvcanary.format.consts" in edges["kvcanary.campaign.x"]
    assert not_layered({"format": {"campaign"}, "campaign": {"format"}}) != []
    assert not_layered({"a": {"b"}, "b": {"c"}, "c": set()}) == [
        "a may import b but not what b may: ['c']"]
    try:
        test_every_module_lives_in_a_folder()
    except AssertionError as exc:
        assert "loose.py" in str(exc)
    else:
        raise AssertionError("a module outside the folders passed")


# Packages whose exported names (``__all__``) are the public API an integration may use.
PUBLIC_PACKAGES = ("kvcanary", "kvcanary.dump", "kvcanary.audit")


def integration_contract() -> set:
    """``kvcanary.<folder>.<module>.<name>`` of every name a folder's README lists on its
    ``Integrations may use:`` line."""
    names = set()
    for folder in folders():
        text = (PACKAGE / folder / "README.md").read_text(encoding="utf-8")
        for line in re.findall(r"^Integrations may use: *(.*)$", text, re.M):
            names.update(f"kvcanary.{folder}.{n.strip()}" for n in line.split(",") if n.strip())
    return names


def outside_the_public_api() -> list:
    """Imports in kvcanary/integrations of anything but another integration module, a public
    package's exported names and the listed contract names."""
    import importlib

    exported = {p: set(importlib.import_module(p).__all__) for p in PUBLIC_PACKAGES}
    contract, found = integration_contract(), []
    files = {module_name(p) for p in PACKAGE.rglob("*.py")}
    for listed in contract:
        module, _, name = listed.rpartition(".")
        assert module in files and hasattr(importlib.import_module(module), name), \
            f"an 'Integrations may use:' line names {listed}, which does not exist"
    for path in sorted((PACKAGE / "integrations").rglob("*.py")):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                bad = [a.name for a in node.names if a.name.startswith("kvcanary")
                       and a.name not in PUBLIC_PACKAGES]
                found += [f"{name}:{node.lineno}: import {b}" for b in bad]
                continue
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("kvcanary") or target.startswith("kvcanary.integrations"):
                continue
            for alias in node.names:
                if target in exported and alias.name in exported[target]:
                    continue
                if f"{target}.{alias.name}" not in contract:
                    found.append(f"{name}:{node.lineno}: {target}.{alias.name} (neither "
                                 "exported by a public package nor on an 'Integrations may "
                                 "use:' line)")
    return found


def test_integrations_use_only_the_public_api():
    assert outside_the_public_api() == []


def test_the_public_api_check_catches_a_folder_import(tmp_path, monkeypatch):
    # The check reads the files: one private reach into a folder is caught.
    probe = PACKAGE / "integrations" / "findings.py"
    text = probe.read_text(encoding="utf-8")
    original = Path.read_text

    def read_text(self, *args, **kwargs):
        if self == probe:
            return text + "\nfrom ..findings.evidence import Evidence\n"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    assert any("kvcanary.findings.evidence.Evidence" in f for f in outside_the_public_api())
