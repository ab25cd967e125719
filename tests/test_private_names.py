"""An underscore means private: no kvcanary module imports another module's underscored name,
reads one through the module (``module._name``), or reaches into an object for an underscored
attribute that only another module defines (``evidence._refs()``). A name another module needs
is public in its own module, and is imported from that module, not through one that imported
it (a package's ``__init__`` may re-export). The failures name the module and the name."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvcanary"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def modules(package: Path) -> dict:
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def defined_private(tree: ast.AST) -> set:
    """Underscored names a module defines: functions, classes, assignments, attributes it
    sets (``self._x = ...``) and its parameters."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
    return {n for n in names if _private(n)}


def offences(package: Path = PACKAGE) -> list:
    files = modules(package)
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in files.items()}
    own = {name: defined_private(tree) for name, tree in trees.items()}
    everywhere = set().union(*own.values())
    found = []
    for name, tree in sorted(trees.items()):
        path = files[name]
        package_name = name if path.name == "__init__.py" else name.rpartition(".")[0]
        bound = {}   # local name -> the kvcanary module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package_name.split(".")[:len(package_name.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("kvcanary"):
                    continue
                for alias in node.names:
                    if _private(alias.name):
                        found.append(f"{name}:{node.lineno}: imports {target}.{alias.name}")
                    if f"{target}.{alias.name}" in files:
                        bound[alias.asname or alias.name] = f"{target}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("kvcanary") and alias.asname:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if base in bound:
                found.append(f"{name}:{node.lineno}: reads {bound[base]}.{node.attr}")
            elif (base not in ("self", "cls") and node.attr not in own[name]
                  and node.attr in everywhere):
                found.append(f"{name}:{node.lineno}: reaches for {node.attr}, private to "
                             "another module")
    return found


def test_no_module_uses_another_modules_private_names():
    found = offences()
    assert not found, "\n".join(found)


def defined_at_top(tree: ast.Module) -> set:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):   # a name defined either way
            names.update(defined_at_top(ast.Module(body=[
                n for n in ast.walk(node) if isinstance(n, ast.stmt) and n is not node],
                type_ignores=[])))
    return names


def exported(tree: ast.Module) -> set:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "__all__"):
            return set(ast.literal_eval(node.value))
    return set()


def reexports(package: Path = PACKAGE) -> list:
    """``from kvcanary.a import name`` where ``a`` is a module (not a package) that does not
    define ``name`` itself but imported it, and does not re-export it on purpose (``__all__``)."""
    files = modules(package)
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in files.items()}
    found = []
    for name, tree in sorted(trees.items()):
        path = files[name]
        package_name = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package_name.split(".")[:len(package_name.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in files or files[target].name == "__init__.py":
                continue
            defined = defined_at_top(trees[target]) | exported(trees[target])
            for alias in node.names:
                if alias.name not in defined and f"{target}.{alias.name}" not in files:
                    found.append(f"{name}:{node.lineno}: imports {alias.name} from {target}, "
                                 "which only imported it")
    return found


def test_names_are_imported_from_the_module_that_defines_them():
    found = reexports()
    assert not found, "\n".join(found)


def test_the_checker_sees_each_kind_of_reach(tmp_path):
    fake = tmp_path / "kvcanary"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "lower.py").write_text(
        "def _helper():\n    pass\n\nclass Table:\n    def _rows(self):\n        return 1\n")
    (fake / "imports.py").write_text("from .lower import _helper\n")
    (fake / "reads.py").write_text("from . import lower\n\nlower._helper()\n")
    (fake / "reaches.py").write_text("def f(table):\n    return table._rows()\n")
    (fake / "fine.py").write_text(
        "class Own:\n    def _mine(self):\n        return self._mine\n\n"
        "def g(x):\n    return x._replace(a=1), Own()._mine()\n")
    found = offences(fake)
    assert [f.split(":")[0] for f in found] == ["kvcanary.imports", "kvcanary.reaches",
                                                "kvcanary.reads"], found
    (fake / "shim.py").write_text("from .lower import Table\n")
    (fake / "user.py").write_text("from .shim import Table\nfrom .lower import Table as T\n")
    assert [f.split(":")[0] for f in reexports(fake)] == ["kvcanary.user"]
