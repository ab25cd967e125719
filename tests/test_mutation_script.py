"""scripts/mutation.py runs on the package as it is laid out: every file it mutates and every
test it runs exists, and every survivor it lists as equivalent is a mutant it makes (the ids
name lines, which move when the code around them does)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("kvcanary_mutation",
                                                  ROOT / "scripts" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_target_and_test_path_exists():
    m = _script()
    for target in m.TARGETS:
        assert (ROOT / target.path).is_file(), target.path
        for test in target.tests:
            if test.startswith("tests/"):
                assert (ROOT / test.split("::")[0]).is_file(), (target.path, test)


def test_every_equivalent_survivor_is_a_mutant_the_script_makes():
    m = _script()
    ids = {mutant.id for mutant in m.all_mutants([])}
    assert not sorted(set(m.EQUIVALENT) - ids)


def test_only_with_a_file_it_does_not_mutate_is_an_error(capsys):
    m = _script()
    try:
        m.main(["--list", "--only", "kvcanary/audit.py"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--only kvcanary/audit.py was accepted")
    assert "--only kvcanary/audit.py: not a mutated file" in capsys.readouterr().err
