"""The transformers guard's log of where each request wrote its own positions
(integrations/transformers/ownwrites.py): the latest write answers, a new record's serial
never sees an old one's writes, and compaction keeps exactly the live requests' latest writes
within a bound. numpy only (no torch)."""

from __future__ import annotations

import numpy as np

from kvcanary.integrations.transformers import ownwrites
from kvcanary.integrations.transformers.ownwrites import OwnWrites


def _add(log, serial, positions, slots, followed=True):
    n = len(positions)
    log.add(np.full(n, serial, dtype=np.int64), np.array(positions, dtype=np.int64),
            np.array(slots, dtype=np.int64), np.full(n, followed))


def test_the_latest_write_of_a_position_answers():
    log = OwnWrites()
    _add(log, 0, [0, 1, 2], [10, 11, 12])
    _add(log, 1, [0, 1], [20, 21])
    _add(log, 0, [1], [30], followed=False)          # written again, elsewhere
    assert log.get(0, 0) == (10, True)
    assert log.get(0, 1) == (30, False)
    assert log.get(1, 1) == (21, True)
    assert log.get(1, 2) is None and log.get(2, 0) is None   # a new serial wrote nothing


def test_compaction_keeps_the_live_requests_latest_writes(monkeypatch):
    monkeypatch.setattr(ownwrites, "MIN_LIMIT", 8)
    log = OwnWrites()
    rng = np.random.default_rng(0)
    latest = {}
    for step in range(200):
        serials = rng.integers(0, 6, size=3)
        positions = rng.integers(0, 5, size=3)
        slots = rng.integers(0, 1000, size=3)
        followed = rng.random(3) < 0.5
        log.add(serials, positions, slots, followed)
        for key in zip(serials.tolist(), positions.tolist(), slots.tolist(), followed.tolist()):
            latest[key[:2]] = key[2:]
        if log.full():
            log.compact(np.array([1, 3, 4]))          # 0, 2 and 5 have finished
            latest = {k: v for k, v in latest.items() if k[0] in (1, 3, 4)}
        assert log.size <= max(ownwrites.MIN_LIMIT, 2 * 3 * 5) + 3
    for serial in (1, 3, 4):
        for position in range(5):
            assert log.get(serial, position) == latest.get((serial, position))
    log.compact(np.array([3]))
    assert log.size <= 5 and log.get(1, 0) is None
