"""The evidence tables answer each finding's questions (who reads this slot, whose record
does this one continue, where does this request start) without scanning every entry: a
diagnosis asks them once per finding, and a scan per question made a flooded dump's
diagnosis quadratic (262,144 findings: about four minutes)."""

from __future__ import annotations

import time

import numpy as np

from kvcanary.findings.evidence import CHAIN_HEAD_INT64, Evidence


def evidence(n: int, seed: int = 0) -> Evidence:
    rng = np.random.default_rng(seed)
    ev = Evidence.from_entries(slots=rng.integers(0, n // 2 + 2, n),
                               positions=rng.integers(0, 4, n), tokens=np.full(n, -1),
                               batch_index=rng.integers(-1, n // 8 + 2, n),
                               request_rows=rng.integers(-1, 8, n))
    ev.links = rng.integers(0, n // 2 + 2, n)    # a few entries share each link
    ev.has_records = True
    return ev


def test_lookups_find_what_a_scan_finds_also_after_a_column_is_replaced():
    ev = evidence(2000)
    for value in range(-2, 1003):
        np.testing.assert_array_equal(ev.users(value), np.flatnonzero(ev.slots == value))
        np.testing.assert_array_equal(ev.parents(value), np.flatnonzero(ev.links == value))
        np.testing.assert_array_equal(
            ev.heads_of(value), np.flatnonzero((ev.batch_index == value) & (ev.positions == 0)))
    ev.slots = ev.slots[::-1].copy()
    ev.positions = np.zeros_like(ev.positions)
    for value in (0, 5, 17):
        np.testing.assert_array_equal(ev.users(value), np.flatnonzero(ev.slots == value))
        np.testing.assert_array_equal(ev.heads_of(value), np.flatnonzero(ev.batch_index == value))
    assert ev.parents(CHAIN_HEAD_INT64).size == 0


def test_a_lookup_costs_about_the_same_in_a_quarter_million_entries_as_in_a_thousand():
    def per_lookup(ev: Evidence) -> float:
        ev.users(0), ev.parents(0), ev.heads_of(0)    # the tables are built once
        started = time.perf_counter()
        for value in range(500):
            ev.users(value), ev.parents(value), ev.heads_of(value), ev.prev_of(value)
        return time.perf_counter() - started

    small, large = per_lookup(evidence(1000)), per_lookup(evidence(1 << 18))
    # A scan per lookup makes the large one hundreds of times the small one.
    assert large < 10 * small + 0.05, (small, large)
