"""A directory dump's ``.npy`` may be a sparse file: its header declares gigabytes that its
holes hold without a byte on disk, and every hole reads as zero. The batch arrays' holes are
padding rows (``req_pool_indices`` 0), which nothing needs to read: loading and auditing such
a dump cost what its files hold, not what their headers declare, and find every live row that
lies between the holes. Dumps built here by a small generator (a header, a seek, a few
rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numpy.lib import format as npy_format

from kvcanary.audit import audit
from kvcanary.dump import DumpError, load, save

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sparse_npy(path, rows: int, values: dict, dtype=np.int64) -> None:
    """An ``.npy`` of ``rows`` entries that holds only ``values`` ({row: value}); the rest is
    holes (the file is extended by seeking, never written)."""
    with open(path, "wb") as handle:
        npy_format.write_array_header_1_0(
            handle, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": (rows,)})
        start = handle.tell()
        for row, value in sorted(values.items()):
            handle.seek(start + row * np.dtype(dtype).itemsize)
            handle.write(np.array([value], dtype).tobytes())
        handle.truncate(start + rows * np.dtype(dtype).itemsize)


def sparse_dump(path, rows: int, live: dict, dtype=np.int64) -> str:
    """A directory dump of ``rows`` batch rows, live only at ``live`` ({batch index: (table
    row, seq_len)}), its two batch arrays sparse files."""
    table = np.arange(1, 1 + 8 * 32, dtype=np.int32).reshape(8, 32)
    save(path, canary=np.zeros((512, 32), np.uint8), req_to_token=table,
         req_pool_indices=np.zeros(1, np.int64), seq_lens=np.zeros(1, np.int64))
    sparse_npy(os.path.join(path, "req_pool_indices.npy"), rows,
               {b: row for b, (row, _) in live.items()}, dtype)
    sparse_npy(os.path.join(path, "seq_lens.npy"), rows,
               {b: length for b, (_, length) in live.items()}, dtype)
    return str(path)


def is_sparse(path) -> bool:
    info = os.stat(path)
    return info.st_blocks * 512 < info.st_size // 4


def require_holes(path) -> None:
    if not is_sparse(os.path.join(path, "seq_lens.npy")):
        pytest.skip("this file system stores no holes: the files hold their zeros")


def test_live_rows_between_holes_are_all_audited(tmp_path):
    """Live rows at random places of a sparse batch, some in one block with their
    neighbours, audit as the same dump written whole: the same rows, entries and findings."""
    rng = np.random.default_rng(36)
    rows = 1 << 22
    batch = np.unique(np.concatenate([rng.integers(0, rows, 12), [0, rows - 1, 4096, 4097]]))
    live = {int(b): (int(rng.integers(1, 8)), int(rng.integers(1, 40))) for b in batch}
    path = sparse_dump(tmp_path / "sparse", rows, live)
    require_holes(path)
    whole = dict(canary=np.zeros((512, 32), np.uint8),
                 req_to_token=np.arange(1, 1 + 8 * 32, dtype=np.int32).reshape(8, 32),
                 req_pool_indices=np.zeros(rows, np.int64), seq_lens=np.zeros(rows, np.int64))
    for b, (row, length) in live.items():
        whole["req_pool_indices"][b], whole["seq_lens"][b] = row, length
    dense = audit(load(save(tmp_path / "whole.npz", **whole)), backend="numpy")
    got = audit(load(path), backend="numpy")
    assert got.live_requests == dense.live_requests == len(live)
    assert got.entries_checked == dense.entries_checked
    assert got.total_violations == dense.total_violations > 0
    assert sorted((f.batch_index, f.position) for f in got.findings) == \
        sorted((f.batch_index, f.position) for f in dense.findings)


def test_a_bad_value_between_holes_is_still_refused(tmp_path):
    rows = 1 << 24
    path = sparse_dump(tmp_path / "negative", rows, {5_000_000: (1, 3)})
    sparse_npy(os.path.join(path, "seq_lens.npy"), rows, {5_000_000: 3, 9_000_001: -7})
    require_holes(path)
    with pytest.raises(DumpError, match=r"key seq_lens: holds a negative value \(-7\)"):
        load(path)
    path = sparse_dump(tmp_path / "outside", rows, {12_345_678: (99, 3)})
    with pytest.raises(DumpError, match=r"req_pool_indices\[12345678\] = 99 is outside"):
        load(path)
    path = sparse_dump(tmp_path / "long", rows, {7_654_321: (2, 1 << 20)})
    with pytest.raises(DumpError, match=r"seq_lens\[7654321\] = 1048576 is more than twice"):
        load(path)


def peak_of_audit(path, limit=3 << 30) -> dict:
    """Peak RSS of loading and auditing ``path`` (text and HTML maps) in a fresh interpreter
    under an address-space limit."""
    script = textwrap.dedent(f"""
        import json, resource
        resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
        start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        from kvcanary.audit import audit
        from kvcanary.dump import load
        from kvcanary.report.maps import ReportMaps
        dump = load({str(path)!r})
        maps = ReportMaps(dump)
        result = audit(dump, backend="numpy", observe=maps.add)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"growth": (peak - start) * 1024, "live": result.live_requests,
                           "violations": result.total_violations}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_gigabyte_of_declared_padding_costs_what_the_files_hold(tmp_path):
    """Two batch arrays declaring 2**27 rows each (2 GiB together, held in a few kilobytes):
    memory stays far below what they declare (before: 1.2 GB and 28 s for 0.6 GB each)."""
    rows = 1 << 27
    path = sparse_dump(tmp_path / "padding", rows, {rows // 3: (1, 5), rows - 1: (2, 3)})
    require_holes(path)
    got = peak_of_audit(path)
    assert got["live"] == 2 and got["violations"] > 0
    assert got["growth"] < 200 << 20, got


def test_widening_a_sparse_narrow_array_is_bounded(tmp_path):
    """An int32 batch array is widened to int64 on load, which allocates 8 bytes per declared
    row: past the bound of an archive's expansion (256 MiB, or 256 times the bytes held) a
    sparse one is refused by name, before anything is allocated; within it, it loads."""
    path = sparse_dump(tmp_path / "narrow", 1 << 27, {5: (1, 3)}, np.int32)
    require_holes(path)
    with pytest.raises(DumpError, match=r"key req_pool_indices: a sparse int32 file declaring "
                                        r"134217728 rows, \d+ bytes of them held: widened"):
        load(path)
    path = sparse_dump(tmp_path / "small", 1 << 22, {5: (1, 3), (1 << 22) - 1: (2, 4)}, np.int32)
    dump = load(path)
    assert dump.req_pool_indices.dtype == np.int64 and dump.live_batch().tolist() == [5, 4194303]


def sweep_dump(path, entries: int, sweep: dict) -> str:
    """A directory dump with no live request and ``entries`` sweep entries, only ``sweep``
    ({index: (slot, prev, position)}) held, the rest holes (slot 0: padding)."""
    save(path, canary=np.zeros((512, 32), np.uint8), req_to_token=np.ones((2, 4), np.int32),
         req_pool_indices=np.zeros(1, np.int64), seq_lens=np.zeros(1, np.int64),
         sweep_slot_indices=np.ones(1, np.int64), sweep_prev_slot_indices=np.full(1, -1, np.int64),
         sweep_positions=np.zeros(1, np.int64))
    for field, key in enumerate(("sweep_slot_indices", "sweep_prev_slot_indices",
                                 "sweep_positions")):
        sparse_npy(os.path.join(path, f"{key}.npy"), entries,
                   {index: values[field] for index, values in sweep.items()})
    return str(path)


def test_sweep_entries_between_holes_audit_as_written_whole(tmp_path):
    """Sweep entries in a sparse file's holes read slot 0, which verify skips: skipping them
    finds what the same entries written whole find (the records are zero: every held entry
    fails), and the summary counts every entry."""
    entries = 1 << 18
    sweep = {3: (7, -1, 2), 150_001: (9, 8, 5), entries - 1: (11, -1, 1)}
    path = sweep_dump(tmp_path / "sparse", entries, sweep)
    if not is_sparse(os.path.join(path, "sweep_positions.npy")):
        pytest.skip("this file system stores no holes")
    whole = {key: np.zeros(entries, np.int64) for key in (
        "sweep_slot_indices", "sweep_prev_slot_indices", "sweep_positions")}
    for index, (slot, prev, position) in sweep.items():
        whole["sweep_slot_indices"][index] = slot
        whole["sweep_prev_slot_indices"][index] = prev
        whole["sweep_positions"][index] = position
    dense = audit(load(save(tmp_path / "whole.npz", canary=np.zeros((512, 32), np.uint8),
                            req_to_token=np.ones((2, 4), np.int32),
                            req_pool_indices=np.zeros(1, np.int64),
                            seq_lens=np.zeros(1, np.int64), **whole)), backend="numpy")
    got = audit(load(path), backend="numpy")
    assert got.sweep_entries == dense.sweep_entries == entries
    assert got.total_violations == dense.total_violations > 0
    assert sorted((f.sweep_index, f.violation.slot_idx) for f in got.findings) == \
        sorted((f.sweep_index, f.violation.slot_idx) for f in dense.findings)
