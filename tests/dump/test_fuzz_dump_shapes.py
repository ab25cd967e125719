"""The fuzz corpus of small dumps that claim much: each hostile shape the red-team rounds
found, built by a generator here with its sizes drawn from a seed, and loaded and audited in
time and memory bounded by the bytes the file holds on disk (a sparse file's holes hold
none), whatever it claims.

* many requests on one block (a block table of ones, ``block_size`` 65,536, seq_lens twice
  the table), the same with every batch entry on one row, and batch entries on one
  per-token row: audited, the work following what is distinct;
* a sparse canary of millions of zero records with one lost write: audited, the lost write
  found as never-written;
* ``.npy`` headers declaring gigabytes (an npz member, a directory file, under an unused
  ``user_`` key), two npz members of one name, an unused ``user_`` member that inflates to
  hundreds of MB, a ``user_`` key of hundreds of characters, a ``block_size`` and a
  ``seq_lens`` of 2**40: refused with one sentence naming the key, or audited unread.

The default run is one example of each shape (seconds in all); ``KVCANARY_FUZZ_EXAMPLES=N``
draws about N more, with larger sizes. The same corpus goes through the ``kvcanary``
command once, in a subprocess under an address-space limit: no traceback, one line per
refused file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import tracemalloc
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fuzz_support import fuzz_examples, hang_guard
from kvcanary.audit import AuditError, audit
from kvcanary.dump import DUMP_VERSION, VERSION_KEY, DumpError, load, save

pytestmark = pytest.mark.fuzz

# Per shape and example: the fixed costs (one verify launch's working set, the interpreter's
# allocations) plus a cost per byte on disk.
# (Measured: at most 1.5 s and 15 MiB each on the loaded 2-core machine; before the fixes,
# one block read by 4,096 requests took minutes, a lost write in a pool of 4M zero records
# hundreds of MB, a forged header or an unused member gigabytes.)
TIME_BASE_S, TIME_PER_BYTE_S = 8.0, 2e-6
MEMORY_BASE, MEMORY_PER_BYTE = 32 << 20, 16
MEMORY_LIMIT = 2 << 30    # RLIMIT_AS of the command run
# A long run (KVCANARY_FUZZ_EXAMPLES set) also draws the larger sizes.
LONG = bool(os.environ.get("KVCANARY_FUZZ_EXAMPLES"))


def npz(path: Path, **arrays) -> str:
    """``arrays`` as a dump ``.npz`` written without ``save``'s checks (which refuse it)."""
    out = str(path) + ".npz"
    np.savez(out, **{VERSION_KEY: np.int64(DUMP_VERSION)}, **arrays)
    return out


def _table_dump(rng, *, one_row: bool) -> dict:
    requests = int(rng.choice([256, 1024, 4096]))
    block_size = int(rng.choice([1 << 12, 1 << 14, 1 << 16] if LONG else [1 << 12, 1 << 14]))
    rows = 1 if one_row else requests
    return dict(canary=np.zeros((2 * block_size, 32), np.uint8),
                block_table=np.ones((rows + 1, 1), np.int64), block_size=np.array(block_size),
                req_pool_indices=(np.ones(requests, np.int64) if one_row
                                  else np.arange(1, requests + 1)),
                seq_lens=np.full(requests, 2 * block_size, np.int64))


def ones_block_table(path: Path, rng) -> str:
    return npz(path, **_table_dump(rng, one_row=False))


def one_row_block_table(path: Path, rng) -> str:
    return npz(path, **_table_dump(rng, one_row=True))


def per_token_row(path: Path, rng) -> str:
    width, requests = int(rng.choice([1 << 10, 1 << 14])), int(rng.choice([512, 4096]))
    table = np.zeros((2, width), np.int64)
    table[1] = np.arange(1, width + 1)
    return npz(path, canary=np.zeros((width + 1, 32), np.uint8), req_to_token=table,
               req_pool_indices=np.ones(requests, np.int64),
               seq_lens=np.full(requests, 2 * width, np.int64))


def sparse_pool_lost_write(path: Path, rng) -> str:
    """A directory dump whose canary.npy is a sparse file of ``2**k`` slots: a few written
    requests at its start, one of their records never written."""
    from test_audit_flood import written

    arrays = written(4, 64)
    small = arrays.pop("canary")
    lost = int(arrays["req_to_token"][2, int(rng.integers(1, 63))])
    small[lost] = 0
    save(str(path), canary=small, **arrays)
    slots = 1 << int(rng.integers(22, 27 if LONG else 23))
    canary = np.lib.format.open_memmap(os.path.join(path, "canary.npy"), mode="w+",
                                       dtype=np.uint8, shape=(slots, small.shape[1]))
    canary[:small.shape[0]] = small
    canary.flush()
    del canary
    return str(path)


def _small(path: Path, suffix: str) -> str:
    table = np.zeros((2, 4), np.int64)
    table[1] = [1, 2, 3, 4]
    return save(str(path) + suffix, canary=np.zeros((5, 32), np.uint8), req_to_token=table,
                req_pool_indices=np.array([1]), seq_lens=np.array([4]))


def _huge_header(rng) -> bytes:
    declared = int(rng.integers(1 << 20, 1 << 32))
    return b"\x93NUMPY\x02\x00" + declared.to_bytes(4, "little") + b" " * int(
        rng.integers(0, 24 << 10))


def huge_header_member(path: Path, rng) -> str:
    out = _small(path, ".npz")
    with zipfile.ZipFile(out, "a") as archive:
        archive.writestr(str(rng.choice(["user_note.npy", "synth_note.npy"])), _huge_header(rng))
    return out


def huge_header_file(path: Path, rng) -> str:
    out = _small(path, "")
    Path(out, "user_note.npy").write_bytes(_huge_header(rng))
    return out


def duplicate_member(path: Path, rng) -> str:
    out = _small(path, ".npz")
    name = str(rng.choice(["seq_lens", "canary", "req_to_token"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # zipfile warns of the duplicate name
        with zipfile.ZipFile(out, "a") as archive, archive.open(f"{name}.npy", "w") as member:
            np.lib.format.write_array(member, np.array([2]))
    return out


def unused_user_bomb(path: Path, rng) -> str:
    out = _small(path, ".npz")
    size = int(rng.integers(40 << 20, (256 if LONG else 48) << 20))
    with zipfile.ZipFile(out, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("user_blob.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, np.zeros(size, np.uint8))
    return out


def long_user_key(path: Path, rng) -> str:
    out = _small(path, ".npz")
    with zipfile.ZipFile(out, "a") as archive:
        with archive.open("user_" + "x" * int(rng.integers(250, 2000)) + ".npy", "w") as member:
            np.lib.format.write_array(member, np.array([1]))
    return out


def huge_block_size(path: Path, rng) -> str:
    arrays = _table_dump(np.random.default_rng(0), one_row=True)
    arrays.update(canary=np.zeros((8, 32), np.uint8),
                  block_size=np.array(1 << int(rng.integers(17, 62))))
    return npz(path, **arrays)


def huge_seq_len(path: Path, rng) -> str:
    table = np.zeros((2, 4), np.int64)
    table[1] = [1, 2, 3, 4]
    return npz(path, canary=np.zeros((5, 32), np.uint8), req_to_token=table,
               req_pool_indices=np.array([1]), seq_lens=np.array([1 << int(rng.integers(4, 63))]))


# shape: (generator, what must come of it: "audited", or a fragment of the refusal)
SHAPES = {
    "ones_block_table": (ones_block_table, "audited"),
    "one_row_block_table": (one_row_block_table, "audited"),
    "per_token_row": (per_token_row, "audited"),
    "sparse_pool_lost_write": (sparse_pool_lost_write, "never-written"),
    "huge_header_member": (huge_header_member, "above the limit of 10000"),
    "huge_header_file": (huge_header_file, "above the limit of 10000"),
    "duplicate_member": (duplicate_member, "the archive holds two members"),
    "unused_user_bomb": (unused_user_bomb, "audited"),
    "long_user_key": (long_user_key, "audited"),
    "huge_block_size": (huge_block_size, "key block_size: must be at most 65536"),
    "huge_seq_len": (huge_seq_len, "key seq_lens"),
}


def disk_bytes(path: str) -> int:
    """Bytes the dump holds on disk (a sparse file's holes hold none)."""
    paths = [os.path.join(path, n) for n in os.listdir(path)] if os.path.isdir(path) else [path]
    return sum(min(os.stat(p).st_size, os.stat(p).st_blocks * 512) for p in paths)


def digest(path: str) -> str:
    """A hash of the dump's names, sizes and data (a sparse file's data extents only)."""
    sha = hashlib.sha256()
    paths = sorted(Path(path).iterdir()) if os.path.isdir(path) else [Path(path)]
    for p in paths:
        size = p.stat().st_size
        sha.update(f"{p.name} {size}".encode())
        with open(p, "rb") as handle:
            at = 0
            while at < size:
                try:
                    at = os.lseek(handle.fileno(), at, os.SEEK_DATA)
                    end = os.lseek(handle.fileno(), at, os.SEEK_HOLE)
                except OSError:   # no data past ``at``
                    break
                handle.seek(at)
                sha.update(at.to_bytes(8, "little") + handle.read(end - at))
                at = end
    return sha.hexdigest()


def outcome_of(path: str) -> str:
    """``load`` then ``audit``: "audited" (plus the causes found) or the refusal's text."""
    try:
        result = audit(load(path), backend="numpy")
    except (DumpError, AuditError) as exc:
        message = str(exc)
        assert message.startswith(path) and "\n" not in message, message
        return message
    return "audited " + " ".join(sorted({f.diagnosis.cause for f in result.findings}))


def examples():
    extra = fuzz_examples(0, share=len(SHAPES)) if os.environ.get("KVCANARY_FUZZ_EXAMPLES") else 0
    return [pytest.param(name, seed, id=f"{name}-{seed}")
            for name in SHAPES for seed in range(1 + extra)]


@pytest.mark.parametrize("name,seed", examples())
def test_a_hostile_shape_costs_what_its_bytes_do(tmp_path, name, seed):
    generator, expected = SHAPES[name]
    path = generator(tmp_path / name, np.random.default_rng(seed))
    size, before = disk_bytes(path), digest(path)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with hang_guard(120):    # a regression that takes minutes stops the run, with stacks
            outcome = outcome_of(path)
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert expected in outcome, outcome
    assert elapsed <= TIME_BASE_S + TIME_PER_BYTE_S * size, (elapsed, size)
    assert peak <= MEMORY_BASE + MEMORY_PER_BYTE * size, (peak, size)
    assert digest(path) == before, "the audit changed the file"


AUDIT = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit})); "
         "sys.argv = ['kvcanary', 'audit', '--backend', 'numpy', '--max-findings', '8'] "
         "+ sys.argv[1:]; from kvcanary.cli import main; main()")


def test_the_corpus_through_the_command_never_crashes(tmp_path):
    paths = {name: generator(tmp_path / name, np.random.default_rng(0))
             for name, (generator, _) in SHAPES.items()}
    done = subprocess.run([sys.executable, "-c", AUDIT.format(limit=MEMORY_LIMIT),
                           *paths.values()], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr, done.stderr
    errors = done.stderr.strip().splitlines()
    for name, (_, expected) in SHAPES.items():
        named = [line for line in errors   # the dump, or a file of a directory dump
                 if paths[name] + ":" in line or paths[name] + os.sep in line]
        if expected.startswith(("audited", "never-written")):
            assert not named and f"summary {paths[name]}:" in done.stdout, (name, named)
        else:
            assert len(named) == 1 and expected in named[0], (name, named)
    assert len(errors) == sum(not e.startswith(("audited", "never-written"))
                              for _, e in SHAPES.values()), errors
