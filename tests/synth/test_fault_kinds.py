"""A fault kind is one registered object (``kvcanary.synth.KINDS``): the synth's per-site
rules and the campaign's "designed to see" column are two readings of the same object and
must agree, every view of the registry is derived from it, and every change function is
some kind's."""

from __future__ import annotations

import inspect

import pytest

from kvcanary.campaign import HIGH, LAYOUTS, LOW, designed
from kvcanary.campaign.layouts import scopes
from kvcanary.synth import (EXPECTED_BITS, FAULT_DESCRIPTIONS, FAULT_KINDS, KINDS, MODES,
                            PAGED_FAULT_DESCRIPTIONS, PAGED_FAULT_KINDS, FaultKind,
                            SynthConfig, inapplicable_kinds, site_bits)
from kvcanary.synth import fault_changes
from kvcanary.synth.fault_kinds import PAIR_KINDS, kind_targets

# One representative verify entry per target class: (entry, predecessor slot); -1 a chain
# head, 0 an unreachable predecessor (a window head's freed SWA slot).
CLASS_SITES = {"head": ("request", -1), "interior": ("request", 5), "last": ("request", 5),
               "chunk-boundary": ("request", 5), "window-head": ("request", 0),
               "shared": ("request", 5), "cached": ("sweep", 5)}
# Whether a changed real-KV byte changes the hash, per (mode, scope).
REAL_KV_VISIBLE = {("none", ""): False, ("partial", LOW): True, ("partial", HIGH): False,
                   ("all", ""): True}


def test_every_kind_is_one_registered_object():
    assert list(KINDS) == list(PAGED_FAULT_KINDS)
    for name, kind in KINDS.items():
        assert isinstance(kind, FaultKind) and kind.name == name
        assert kind.description and callable(kind.apply)
        assert set(kind.targets) <= set(CLASS_SITES) and kind_targets(name) == kind.targets


def test_the_views_of_the_registry():
    assert FAULT_KINDS == tuple(n for n, k in KINDS.items() if not k.paged_only)
    assert dict(EXPECTED_BITS) == {n: k.bits for n, k in KINDS.items()}
    assert dict(FAULT_DESCRIPTIONS) == {n: KINDS[n].description for n in FAULT_KINDS}
    assert all(PAGED_FAULT_DESCRIPTIONS[n] == (k.paged_description or k.description)
               for n, k in KINDS.items())
    assert PAIR_KINDS == tuple(n for n, k in KINDS.items() if k.pairable)
    no_sources = SynthConfig(requests=4, num_slots=256, sources=0)
    assert set(inapplicable_kinds(no_sources)) == {n for n, k in KINDS.items() if k.needs_sources}
    for layout in LAYOUTS.values():
        for name in layout.kinds:
            assert all(layout.injections(name, mode) == len(scopes(name, mode))
                       for mode in MODES)


def test_every_change_function_belongs_to_one_kind():
    changes = {f for name, f in inspect.getmembers(fault_changes, inspect.isfunction)
               if f.__module__ == fault_changes.__name__
               and list(inspect.signature(f).parameters) == ["inj", "target", "i"]}
    applied = [kind.apply for kind in KINDS.values()]
    assert sorted(applied, key=id) == sorted(changes, key=id) and len(set(applied)) == len(KINDS)


@pytest.mark.parametrize("name", list(KINDS))
def test_site_rules_and_blind_spots_agree(name):
    """Under kvcanary's rules, a cell is designed to be seen exactly where the kind's site
    rule fires bits at that class's entry (the campaign's column and synth's ground truth
    are one object read twice)."""
    kind = KINDS[name]
    for target in kind.targets:
        entry, prev = CLASS_SITES[target]
        for mode in MODES:
            for scope in scopes(name, mode):
                visible = REAL_KV_VISIBLE.get((mode, scope), True)
                fires = site_bits(name, entry, 3, prev, visible) != 0
                should, why = designed(name, mode, scope, "kvcanary", target)
                assert should == fires, (name, target, mode, scope, why)
                assert should == (why == "")


def test_compat_hides_only_the_extension_kinds():
    """--compat turns off kvcanary's own checks: only slot-zero has a blind spot there."""
    hidden = {name for name in KINDS
              if not designed(name, "all", "", "compat", "interior")[0]}
    assert hidden == {"slot-zero"}
