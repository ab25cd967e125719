"""Hostile and unlucky inputs: a few kilobytes of dump never cost minutes or gigabytes, and
nothing a dump claims makes the audit hang, crash or read outside an array. Every hostile
input is built here by a small generator; the memory checks run in a subprocess under an
address-space limit so a regression fails instead of taking the machine."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvcanary.audit import audit
from kvcanary.dump import VERSION_KEY, save

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_request(table: np.ndarray, seq_len: int, num_slots: int, **extra) -> dict:
    """A dump of one live request on table row 1 over a zeroed canary."""
    return dict(canary=np.zeros((num_slots, 32), np.uint8), req_to_token=table,
                req_pool_indices=np.array([1], np.int64),
                seq_lens=np.array([seq_len], np.int64), **extra)


def shared_slot_dump(path, entries: int) -> str:
    """``entries`` live positions that all map slot 1 (a row filled with one slot)."""
    return save(path, **one_request(np.ones((2, entries), np.int32), entries, 64))


def distinct_slot_dump(path, entries: int) -> str:
    """The same count of violating entries, each on its own slot."""
    table = np.zeros((2, entries), np.int32)
    table[1] = np.arange(1, entries + 1)
    return save(path, **one_request(table, entries, entries + 1))


def shared_sweep_dump(path, entries: int) -> str:
    """``entries`` sweep entries on slot 1, no live request."""
    return save(path, canary=np.zeros((64, 32), np.uint8), req_to_token=np.ones((2, 1), np.int32),
                req_pool_indices=np.array([0], np.int64), seq_lens=np.array([0], np.int64),
                sweep_slot_indices=np.ones(entries, np.int64),
                sweep_prev_slot_indices=np.full(entries, -1, np.int64),
                sweep_positions=np.zeros(entries, np.int64))


def median_audit_seconds(path, repeats: int = 3):
    times, result = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        result = audit(path, backend="numpy")
        times.append(time.perf_counter() - began)
    return statistics.median(times), result


# ------------------------------------------------------------ item 1: shared slots


@pytest.mark.parametrize("build", [shared_slot_dump, shared_sweep_dump], ids=["live", "sweep"])
def test_entries_sharing_one_slot_audit_about_as_fast_as_distinct_slots(tmp_path, build):
    entries = 1 << 16
    baseline, clean_like = median_audit_seconds(distinct_slot_dump(tmp_path / "d.npz", entries))
    took, result = median_audit_seconds(build(tmp_path / "s.npz", entries))
    assert clean_like.total_violations == result.total_violations == entries
    assert result.unattributed == 0 and len(result.findings) == 1024
    # 2x is the goal; the margin absorbs a loaded machine (before the fix: ~300x)
    assert took <= 4 * baseline + 0.1, (took, baseline)
