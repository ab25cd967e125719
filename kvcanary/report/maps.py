"""The report's two maps, aggregated over every violation row of an audit.

* The request map: live requests (rows, in batch order) by position (columns). Each cell
  covers a few requests and positions and holds the entries checked there, the rows attributed
  to them, and the reason most of those rows have (a row's reason is its most telling bit,
  :data:`REASON_ORDER`).
* The pool map: the canary slots (or, on a paged dump, its blocks) in order, wrapped into a
  grid. A cell counts the slots or blocks in it that plan entries use, that hold a finding and
  that are mapped twice (entries map them at two different positions; a cached prefix shared
  by several requests at the same position is not "twice", nor is padding slot 0).

Both grids are bounded (:data:`REQUEST_MAP_ROWS` x :data:`REQUEST_MAP_COLUMNS` and
:data:`POOL_MAP_CELLS` cells), whatever the dump's size, so a report of a dump whose every
record is corrupt stays small. The work is a few vectorised passes over each launch.
"""

from __future__ import annotations

import base64

import numpy as np

from ..format.consts import FailReason
from ..format.violations import reason_label

# Most telling first: where a row has several bits, its colour is the first one set.
REASON_ORDER = (FailReason.SLOT_OUT_OF_RANGE, FailReason.SLOT_ZERO_IN_PREFIX,
                FailReason.VERIFY_POSITION_MISMATCH, FailReason.VERIFY_TOKEN_MISMATCH,
                FailReason.VERIFY_CHAIN_HASH_MISMATCH, FailReason.VERIFY_REAL_KV_HASH_MISMATCH,
                FailReason.WRITE_TOKEN_MISMATCH, FailReason.WRITE_POSITION_MISMATCH,
                FailReason.WRITE_SLOT_CONFLICT)
REASON_LABELS = tuple(reason_label(bit) for bit in REASON_ORDER) + ("other",)
# At most 64 x 192 cells, so that a cell is at least the page's 5 pixels a side (room for the
# mark that tells states apart without their colour) in its 960 x 320 pixel map.
REQUEST_MAP_ROWS = 64
REQUEST_MAP_COLUMNS = 192
POOL_MAP_CELLS = 8192
POOL_MAP_COLUMNS = 128
# Slots (or blocks) mapped twice named by id in the report.
TWICE_LISTED = 32

# Request-map cell codes: 0 nothing checked, 1 checked and clean, 2 + k: reason k.
CELL_EMPTY, CELL_CLEAN, CELL_REASON = 0, 1, 2
# Pool-map cell flags.
POOL_USED, POOL_FINDING, POOL_TWICE = 1, 2, 4


def _primary_table() -> np.ndarray:
    """Primary reason of every combination of the known bits (one lookup per row)."""
    known = sum(int(bit) for bit in REASON_ORDER)
    table = np.full(known + 1, len(REASON_ORDER), dtype=np.int64)
    for value in range(known + 1):
        table[value] = next((i for i, bit in enumerate(REASON_ORDER) if value & int(bit)),
                            len(REASON_ORDER))
    return table


_PRIMARY = _primary_table()
_KNOWN_BITS = _PRIMARY.size - 1   # REASON_ORDER holds every bit below the highest one


def primary_reasons(bits: np.ndarray) -> np.ndarray:
    """Index into :data:`REASON_LABELS` of each row's most telling reason bit (the first of
    :data:`REASON_ORDER` it has; ``other`` for none of them)."""
    return _PRIMARY[np.asarray(bits, dtype=np.int64) & _KNOWN_BITS]


def _encode(array: np.ndarray, dtype) -> str:
    """Little-endian bytes as base64, the way the page's script reads them."""
    return base64.b64encode(np.ascontiguousarray(array, dtype=dtype).tobytes()).decode("ascii")


def _counts(array: np.ndarray) -> dict:
    """Non-negative counts in the fewest bytes per value that hold the largest:
    ``{"bytes": 1, 2 or 4, "data": base64}`` (the page's script reads either)."""
    top = int(array.max()) if array.size else 0
    width = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4
    return {"bytes": width, "data": _encode(np.minimum(array, (1 << 32) - 1), f"<u{width}")}


def _grid(count: int, limit: int) -> tuple:
    """``(per_cell, cells)``: the fewest items per cell that fit ``count`` items in
    ``limit`` cells."""
    count = max(1, int(count))
    per = -(-count // limit)
    return per, -(-count // per)


def _pool_columns(cells: int) -> int:
    """A power of two (so a row starts at a round slot number) giving a grid about twice as
    wide as tall, at most :data:`POOL_MAP_COLUMNS`."""
    columns = 16
    while columns < POOL_MAP_COLUMNS and columns * columns < 2 * cells:
        columns *= 2
    return min(columns, max(1, cells))


class ReportMaps:
    """Aggregates an audit's launches into the report's maps.

    Build it from the dump, hand :meth:`add` to ``kvcanary.audit.audit(..., observe=...)``,
    then :meth:`to_dict` gives the maps as plain data (what :func:`kvcanary.report.write_html`
    draws)::

        maps = ReportMaps(dump)
        result = audit(dump, observe=maps.add)
        section = audit_section(result, maps, dump_metadata(dump))

    Memory: 7 bytes per canary slot (a fifth of the canary itself), plus the bounded grids."""

    def __init__(self, dump):
        self.num_slots = dump.num_slots
        self.block_size = int(dump.block_size) if dump.block_table is not None else 0
        live_batch = getattr(dump, "live_batch", None)   # a Dump's skips sparse padding
        live = live_batch() if live_batch is not None else np.flatnonzero(
            np.asarray(dump.req_pool_indices) != 0)
        self.live_requests = int(live.size)
        self.live = live   # a live batch index's rank is its place here
        self.request_rows = np.asarray(dump.req_pool_indices[live], dtype=np.int64)
        self.positions = int(np.asarray(dump.seq_lens[live]).max()) if live.size else 1
        self.requests_per_row, self.rows = _grid(live.size, REQUEST_MAP_ROWS)
        self.positions_per_column, self.columns = _grid(self.positions, REQUEST_MAP_COLUMNS)
        cells = self.rows * self.columns
        self.cell_entries = np.zeros(cells, dtype=np.int64)
        self.cell_rows = np.zeros(cells, dtype=np.int64)
        self.cell_reasons = np.zeros((cells, len(REASON_LABELS)), dtype=np.int64)
        # The pool: per slot, used / with a finding / mapped twice; rows per pool-map cell.
        self.unit_slots = self.block_size or 1
        self.units = -(-self.num_slots // self.unit_slots)
        self.units_per_cell, self.pool_cells = _grid(self.units, POOL_MAP_CELLS)
        self.cell_pool_rows = np.zeros(self.pool_cells, dtype=np.int64)
        self.slot_hit = np.zeros(self.num_slots, dtype=bool)
        self.slot_used = np.zeros(self.num_slots, dtype=bool)
        self.slot_twice = np.zeros(self.num_slots, dtype=bool)
        sweep = getattr(dump, "sweep_positions", None)
        ranges = dump.row_ranges("sweep_positions") if sweep is not None and sweep.size and \
            hasattr(dump, "row_ranges") else [(0, 0 if sweep is None else sweep.size)]
        widest = max([self.positions] + [int(np.abs(sweep[begin:end]).max())
                                         for begin, end in ranges if end > begin])
        position_type = np.int32 if widest < np.iinfo(np.int32).max else np.int64
        self.slot_position = np.full(self.num_slots, -1, dtype=position_type)
        self.outside_rows = self.sweep_rows = self.unattributed_rows = 0

    # ------------------------------------------------------------------ aggregation

    def _cells(self, batch_index: np.ndarray, positions: np.ndarray) -> np.ndarray:
        rank = np.searchsorted(self.live, batch_index)
        column = np.minimum(positions // self.positions_per_column, self.columns - 1)
        return (rank // self.requests_per_row) * self.columns + column

    def add(self, launch) -> None:
        """Take one :class:`kvcanary.audit.CheckedLaunch` into the maps."""
        slots, positions = launch.slots, launch.positions
        inside = (slots >= 0) & (slots < self.num_slots)
        self._add_mappings(slots[inside], positions[inside])
        rows, entry_of = launch.rows, launch.entry_of
        row_slots = np.ascontiguousarray(rows[:, 1])
        row_inside = (row_slots >= 0) & (row_slots < self.num_slots)
        self.outside_rows += int(rows.shape[0] - np.count_nonzero(row_inside))
        hit = row_slots[row_inside]
        self.slot_hit[hit] = True
        np.add.at(self.cell_pool_rows, hit // (self.unit_slots * self.units_per_cell), 1)
        attributed = entry_of >= 0
        self.unattributed_rows += int(rows.shape[0] - np.count_nonzero(attributed))
        if launch.batch_index is None:
            self.sweep_rows += int(np.count_nonzero(attributed))
            return
        cells = self._cells(launch.batch_index, positions)
        np.add.at(self.cell_entries, cells, 1)
        row_cells = cells[entry_of[attributed]]
        np.add.at(self.cell_rows, row_cells, 1)
        keys = row_cells * len(REASON_LABELS) + primary_reasons(rows[attributed, 7])
        np.add.at(self.cell_reasons.reshape(-1), keys, 1)

    def _add_mappings(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """Mark used slots, and slots entries map at two different positions (within this
        launch, or against the position an earlier launch mapped). Padding slot 0 (the null
        block on a paged dump) is never "twice": entries on it are findings already."""
        self.slot_used[slots] = True
        real = slots >= self.unit_slots
        slots, positions = slots[real], positions[real]
        earlier = self.slot_position[slots]
        self.slot_twice[slots[(earlier >= 0) & (earlier != positions)]] = True
        self.slot_position[slots] = positions        # one of the launch's positions wins ...
        differs = self.slot_position[slots] != positions
        self.slot_twice[slots[differs]] = True       # ... and any other one differs from it

    # ------------------------------------------------------------------ output

    def _units(self, per_slot: np.ndarray) -> np.ndarray:
        """Per slot, or per block on a paged dump (true where any of its slots is)."""
        if self.unit_slots == 1:
            return per_slot
        padded = np.pad(per_slot, (0, self.units * self.unit_slots - per_slot.size))
        return padded.reshape(self.units, self.unit_slots).any(axis=1)

    def request_map(self) -> dict:
        reasons = self.cell_reasons
        codes = np.where(self.cell_entries > 0, CELL_CLEAN, CELL_EMPTY)
        codes = np.where(self.cell_rows > 0, CELL_REASON + reasons.argmax(axis=1), codes)
        return {"rows": self.rows, "columns": self.columns,
                "requests_per_row": self.requests_per_row,
                "positions_per_column": self.positions_per_column,
                "live_requests": self.live_requests, "positions": self.positions,
                "block_size": self.block_size,
                "request_rows": _encode(self.request_rows, "<i8"),
                "codes": _encode(codes, "u1"), "entries": _counts(self.cell_entries),
                "violations": _counts(self.cell_rows),
                "violations_total": int(self.cell_rows.sum()),
                "reasons": list(REASON_LABELS),
                "counts_by_reason": {label: int(count) for label, count in
                                     zip(REASON_LABELS, reasons.sum(axis=0)) if count}}

    def pool_map(self) -> dict:
        per, cells = self.units_per_cell, self.pool_cells
        pad = per * cells - self.units

        def per_cell(flags):
            return np.pad(flags, (0, pad)).reshape(cells, per).sum(axis=1, dtype=np.int64)

        used, hit, twice = (self._units(a) for a in (self.slot_used, self.slot_hit,
                                                     self.slot_twice))
        used_cells, hit_cells, twice_cells = per_cell(used), per_cell(hit), per_cell(twice)
        flags = ((used_cells > 0) * POOL_USED + (hit_cells > 0) * POOL_FINDING
                 + (twice_cells > 0) * POOL_TWICE)
        twice_ids = np.flatnonzero(twice)
        return {"unit": "block" if self.block_size else "slot", "units": self.units,
                "block_size": self.block_size, "per_cell": per, "cells": cells,
                "columns": _pool_columns(cells),
                "flags": _encode(flags, "u1"), "used": _counts(used_cells),
                "with_findings": _counts(hit_cells), "rows_on": _counts(self.cell_pool_rows),
                "twice": _counts(twice_cells),
                "used_total": int(used.sum()), "with_findings_total": int(hit.sum()),
                "twice_total": int(twice_ids.size),
                "twice_listed": twice_ids[:TWICE_LISTED].tolist(),
                "rows_outside": self.outside_rows}

    def to_dict(self) -> dict:
        """``{"requests": ..., "pool": ...}``: the grids (base64 little-endian arrays, row
        major) with their scales and totals, plus the rows no request map cell holds."""
        return {"requests": self.request_map(), "pool": self.pool_map(),
                "sweep_rows": self.sweep_rows, "unattributed_rows": self.unattributed_rows}
