"""Corrupted dump files: ``kvcanary.dump.load`` and ``kvcanary audit`` must refuse them with
one sentence naming the file, in bounded memory and time, and never change them.

* hypothesis corrupts valid dumps of every container (truncation, bit flips aimed at the
  headers: zip local and central directory records, ``.npy`` headers, the safetensors length
  and JSON; byte overwrites): ``load`` returns a dump or raises ``DumpError`` naming the file.
* a fixed corpus of hostile files (zip bombs, overlapping members, pickles, huge declared
  shapes, forged sizes) goes through the ``kvcanary`` command in a subprocess under
  ``RLIMIT_AS`` and a timeout: exit 2, one line on stderr, no traceback, file unchanged.
* random corruptions go through the command too: exit 0, 1 or 2, never a traceback.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_support import fuzz_settings, hang_guard
from kvcanary.audit import AuditError, audit
from kvcanary.dump import DumpError, load, save

pytestmark = pytest.mark.fuzz

FLAVOURS = ("npz", "dir", "safetensors")
MEMORY_LIMIT = 2 << 30       # RLIMIT_AS of the audit subprocess
TIME_LIMIT = 60              # seconds per audit subprocess (a refused file takes < 2 s)
SETTINGS = fuzz_settings(300)


def dump_arrays():
    rng = np.random.default_rng(5)
    table = np.zeros((3, 8), np.int32)
    table[1, :6] = np.arange(1, 7)
    table[2, :4] = np.arange(7, 11)
    return dict(
        canary=rng.integers(0, 255, size=(12, 32), dtype=np.uint8),
        req_to_token=table, req_pool_indices=np.array([1, 2], np.int64),
        seq_lens=np.array([6, 4], np.int64), launch_tag="TAIL_K_FULL",
        real_kv_0=rng.standard_normal((12, 8)).astype(np.float32),
        real_kv_params=np.array([[1, 32, 32]], np.int64), real_kv_hash_mode="all",
        expected_tokens=rng.integers(0, 50, size=(3, 8)).astype(np.int32),
        expected_tokens_valid_lens=np.array([6, 4], np.int64),
        sweep_slot_indices=np.array([11], np.int64),
        sweep_prev_slot_indices=np.array([-1], np.int64),
        sweep_positions=np.array([0], np.int64))


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """One valid dump per container: {flavour: {relative file: bytes}}."""
    root = tmp_path_factory.mktemp("originals")
    result = {}
    for flavour in FLAVOURS:
        path = save(root / ("d" if flavour == "dir" else f"d.{flavour}"), **dump_arrays())
        load(path)
        if flavour == "dir":
            result[flavour] = {name: (Path(path) / name).read_bytes()
                               for name in sorted(os.listdir(path))}
        else:
            result[flavour] = {"": Path(path).read_bytes()}
    return result


def materialise(directory: Path, flavour: str, files: dict, name: str = "c") -> str:
    """Write ``files`` as a dump of ``flavour`` under ``directory``; returns its path."""
    if flavour == "dir":
        path = directory / name
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        for file, data in files.items():
            (path / file).write_bytes(data)
        return str(path)
    path = directory / f"{name}.{flavour}"
    path.write_bytes(files[""])
    return str(path)


def digest(path: str) -> str:
    sha = hashlib.sha256()
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            sha.update(name.encode())
            sha.update(Path(path, name).read_bytes())
    else:
        sha.update(Path(path).read_bytes())
    return sha.hexdigest()


# --------------------------------------------------------------------------- corruptions


def header_regions(data: bytes) -> list:
    """Byte ranges holding container metadata: the start of the file, .npy headers, zip
    local and central directory records and the end-of-central-directory record."""
    regions = [(0, min(len(data), 160))]
    for signature, length in ((b"PK\x03\x04", 30 + 40), (b"PK\x01\x02", 46 + 40),
                              (b"PK\x05\x06", 22), (b"PK\x06\x06", 56), (b"\x93NUMPY", 128)):
        start = data.find(signature)
        while start >= 0:
            regions.append((start, min(len(data), start + length)))
            start = data.find(signature, start + 1)
    return regions


@st.composite
def corruptions(draw, originals):
    flavour = draw(st.sampled_from(FLAVOURS))
    files = dict(originals[flavour])
    file = draw(st.sampled_from(sorted(files)))
    data = bytearray(files[file])
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "flip", "flip", "truncate", "overwrite", "extend"]))
        if not data:
            break
        if op == "truncate":
            del data[draw(st.integers(0, len(data) - 1)):]
            continue
        if op == "extend":
            data += draw(st.binary(min_size=1, max_size=64))
            continue
        region = draw(st.sampled_from(header_regions(bytes(data)) + [(0, len(data))]))
        position = draw(st.integers(region[0], max(region[0], region[1] - 1)))
        if op == "flip":
            data[position] ^= 1 << draw(st.integers(0, 7))
        else:
            chunk = draw(st.binary(min_size=1, max_size=16))
            data[position:position + len(chunk)] = chunk
    files[file] = bytes(data)
    return flavour, files


def check_load(path: str) -> str:
    """``load`` either works (and the dump audits or is refused with ``AuditError``) or
    raises ``DumpError`` naming the file; returns the outcome."""
    before = digest(path)
    with hang_guard(60):
        started = time.monotonic()
        try:
            dump = load(path)
            outcome = "loaded"
            try:  # a dump that loads audits, or is refused as unauditable
                audit(dump, backend="numpy")
            except AuditError as exc:
                assert str(exc).startswith(path), str(exc)
        except DumpError as exc:
            message = str(exc)
            assert message.startswith(path), message
            assert "\n" not in message.strip(), message
            outcome = "refused"
        assert time.monotonic() - started < 10
    assert digest(path) == before, "load changed the file"
    return outcome


def test_fuzz_load_of_corrupted_dumps(originals, tmp_path):
    outcomes = []

    @SETTINGS
    @given(case=corruptions(originals))
    def run(case):
        flavour, files = case
        outcomes.append(check_load(materialise(tmp_path, flavour, files)))

    run()
    assert "refused" in outcomes


# --------------------------------------------------------------------------- hostile corpus


def npy_bytes(array, **kwargs) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, **kwargs)
    return buffer.getvalue()


def reshaped_npy(npy: bytes, old: bytes, new: bytes) -> bytes:
    """``npy`` (format 1.0) with the shape text ``old`` in its header replaced by ``new``."""
    (length,) = struct.unpack("<H", npy[8:10])
    header = npy[10:10 + length].replace(old, new, 1)
    return npy[:8] + struct.pack("<H", len(header)) + header + npy[10 + length:]


def huge_shape_npy(dtype, shape: tuple) -> bytes:
    """A .npy header declaring ``shape`` followed by one element of data."""
    return reshaped_npy(npy_bytes(np.zeros(1, dtype)), b"(1,)", repr(shape).encode())


def members(arrays) -> dict:
    result = {f"{k}.npy": npy_bytes(np.asarray(v)) for k, v in arrays.items()}
    result["kvcanary_dump_version.npy"] = npy_bytes(np.array(1, np.int64))
    return result


def write_zip(path: Path, files: dict, method=zipfile.ZIP_STORED) -> str:
    with zipfile.ZipFile(path, "w", method) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return str(path)


def patch_central(data: bytes, index: int, field_offset: int, value: int) -> bytes:
    """Overwrite a 4-byte field of the ``index``-th central directory record."""
    at = -1
    for _ in range(index + 1):
        at = data.find(b"PK\x01\x02", at + 1)
    out = bytearray(data)
    out[at + field_offset:at + field_offset + 4] = struct.pack("<I", value)
    return bytes(out)


def deflate_bomb(path: Path, total: int) -> str:
    """An honest .npz whose canary member inflates to ``total`` bytes of zeros."""
    files = members({k: v for k, v in dump_arrays().items() if k != "canary"
                     and not k.startswith(("real_kv", "expected", "sweep", "launch"))})
    rows = total // 32
    header = reshaped_npy(npy_bytes(np.zeros((0, 32), np.uint8)), b"(0, 32)",
                          f"({rows}, 32)".encode())
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        with archive.open("canary.npy", "w", force_zip64=True) as member:
            member.write(header)
            zeros = bytes(16 << 20)
            for _ in range(rows * 32 // len(zeros)):
                member.write(zeros)
    return str(path)


def hostile_corpus(directory: Path) -> dict:
    """{label: path} of files that must be refused."""
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {k: v for k, v in dump_arrays().items()
              if not k.startswith(("real_kv", "launch"))}
    base = members(arrays)
    corpus = {}

    def npz(label, files, method=zipfile.ZIP_STORED):
        corpus[label] = write_zip(directory / f"{label}.npz", files, method)

    npz("huge_shape_member", dict(base, **{"canary.npy": huge_shape_npy(np.uint8, (1 << 36,))}),
        zipfile.ZIP_DEFLATED)
    npz("not_npy_member", dict(base, **{"canary.npy": b"hello, not an array"}))
    npz("pickled_member", dict(base, **{"seq_lens.npy": npy_bytes(
        np.array([{"x": 1}], dtype=object), allow_pickle=True)}))
    npz("bzip2_member", base, zipfile.ZIP_BZIP2)
    stored = Path(write_zip(directory / "stored.npz", base)).read_bytes()
    (directory / "forged_size.npz").write_bytes(patch_central(stored, 1, 24, 0xFFFFFFF0))
    corpus["forged_size"] = str(directory / "forged_size.npz")
    (directory / "overlap.npz").write_bytes(patch_central(stored, 2, 42, 0))
    corpus["overlap"] = str(directory / "overlap.npz")
    deflated = Path(write_zip(directory / "deflated.npz", base, zipfile.ZIP_DEFLATED)).read_bytes()
    (directory / "forged_ratio.npz").write_bytes(patch_central(deflated, 0, 24, 0x7FFFFFFF))
    corpus["forged_ratio"] = str(directory / "forged_ratio.npz")
    at = stored.find(b"PK\x01\x02") + 46  # the first central record's file name
    (directory / "control_name.npz").write_bytes(stored[:at] + b"\n" + stored[at + 1:])
    corpus["control_name"] = str(directory / "control_name.npz")
    (directory / "truncated.npz").write_bytes(stored[: len(stored) // 2])
    corpus["truncated"] = str(directory / "truncated.npz")
    (directory / "pickle.npz").write_bytes(pickle.dumps({"canary": [1, 2, 3]}))
    corpus["pickle"] = str(directory / "pickle.npz")
    (directory / "empty.npz").write_bytes(b"")
    corpus["empty"] = str(directory / "empty.npz")
    corpus["deflate_bomb"] = deflate_bomb(directory / "deflate_bomb.npz", 320 << 20)

    def dump_dir(label, replace):
        path = directory / label
        save(path, **arrays)
        for name, data in replace.items():
            (path / name).write_bytes(data)
        corpus[label] = str(path)

    dump_dir("dir_huge_shape", {"seq_lens.npy": huge_shape_npy(np.int64, (1 << 40,))})
    dump_dir("dir_huge_2d", {"canary.npy": huge_shape_npy(np.uint8, (1 << 31, 1 << 20))})
    dump_dir("dir_pickled", {"seq_lens.npy": npy_bytes(np.array([object()], dtype=object),
                                                       allow_pickle=True)})
    dump_dir("dir_truncated", {"canary.npy": npy_bytes(arrays["canary"])[:90]})
    dump_dir("dir_garbage", {"req_to_token.npy": b"\x93NUMPY\x01\x00" + b"\xff" * 40})
    dump_dir("dir_bad_magic", {"seq_lens.npy": b"SECRET=hunter2\n"})
    # A valid file holding a corrupt value: 4M positions past an 8-column table used to make
    # the audit enumerate them all (minutes; 2**26 and up ran out of memory).
    dump_dir("dir_seq_len_flip", {"seq_lens.npy": npy_bytes(np.array([6 | 1 << 22, 4]))})
    # A code point past U+10FFFF: numpy used to hand back a string with a deferred SystemError.
    dump_dir("dir_bad_unicode", {"launch_tag.npy": npy_bytes(np.array("TAIL_K_FULL")).replace(
        b"K\x00\x00\x00", b"K\x00\x00\x01")})

    # Few bytes claiming much: a table without rows but 2**40 columns, a block of 2**20
    # tokens behind four block-table entries (each used to cost about a gigabyte).
    npz("wide_empty_table", dict(base, **{
        "req_to_token.npy": npy_bytes(np.zeros((0, 1 << 40), np.int32)),
        "seq_lens.npy": npy_bytes(np.full(arrays["seq_lens"].shape, 1 << 20, np.int64))}))
    paged = {k: v for k, v in base.items() if k != "req_to_token.npy"}
    npz("paged_huge_block", dict(paged, **{
        "block_table.npy": npy_bytes(np.ones((arrays["req_to_token"].shape[0], 1), np.int32)),
        "block_size.npy": npy_bytes(np.array(1 << 20, np.int64)),
        "seq_lens.npy": npy_bytes(np.full(arrays["seq_lens"].shape, 1 << 21, np.int64))}))
    dump_dir_outside = directory / "dir_link_outside"
    save(dump_dir_outside, **arrays)
    (directory / "outside.npy").write_bytes((dump_dir_outside / "seq_lens.npy").read_bytes())
    (dump_dir_outside / "seq_lens.npy").unlink()
    (dump_dir_outside / "seq_lens.npy").symlink_to(directory / "outside.npy")
    corpus["dir_link_outside"] = str(dump_dir_outside)

    good = Path(save(directory / "good.safetensors", **arrays)).read_bytes()
    (length,) = struct.unpack("<Q", good[:8])
    header = good[8:8 + length]

    def st_file(label, data):
        (directory / f"{label}.safetensors").write_bytes(data)
        corpus[label] = str(directory / f"{label}.safetensors")

    st_file("st_huge_length", struct.pack("<Q", 1 << 40) + good[8:])
    st_file("st_length_past_end", struct.pack("<Q", length + 4096) + good[8:])
    forged = header.replace(b'"shape":[12,32]', b'"shape":[1099511627776,32]')
    assert forged != header
    st_file("st_huge_shape", struct.pack("<Q", len(forged)) + forged + good[8 + length:])
    st_file("st_json_garbage", good[:8] + b"{" * length + good[8 + length:])
    st_file("st_json_list", struct.pack("<Q", 2) + b"[]" + good[8 + length:])
    st_file("st_truncated", good[: 8 + length + 10])
    st_file("st_empty", b"")
    big = (b'{"__metadata__":{"synth_note":"' + b"x" * (2 << 20) + b'"},'
           + header[1:])
    st_file("st_big_header", struct.pack("<Q", len(big)) + big + good[8 + length:])
    return corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return hostile_corpus(tmp_path_factory.mktemp("hostile"))


AUDIT = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit})); "
         "sys.argv = ['kvcanary', 'audit', '--backend', 'numpy'] + sys.argv[1:]; "
         "from kvcanary.cli import main; main()")


def run_audit(paths: list, *extra) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", AUDIT.format(limit=MEMORY_LIMIT), *extra, *paths]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIME_LIMIT)


def test_hostile_files_exit_2_with_one_sentence_in_bounded_memory(corpus):
    labels = sorted(corpus)
    before = {label: digest(corpus[label]) for label in labels}
    started = time.monotonic()
    # Two at a time (this machine's cores); each its own process and memory limit.
    for pair in [labels[i:i + 2] for i in range(0, len(labels), 2)]:
        procs = {label: subprocess.Popen(
            [sys.executable, "-c", AUDIT.format(limit=MEMORY_LIMIT), corpus[label]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for label in pair}
        for label, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=TIME_LIMIT)
            path = corpus[label]
            assert proc.returncode == 2, (label, proc.returncode, stdout, stderr)
            lines = stderr.strip().splitlines()
            assert len(lines) == 1, (label, stderr)
            assert lines[0].startswith("kvcanary: error: ") and path in lines[0], (label, stderr)
            assert "Traceback" not in stderr and "MemoryError" not in stderr, (label, stderr)
            assert stdout == "", (label, stdout)
            assert digest(path) == before[label], f"{label}: the audit changed the file"
    assert time.monotonic() - started < TIME_LIMIT * 2


@pytest.mark.parametrize("label,fragment", [
    ("deflate_bomb", "a likely zip bomb"), ("overlap", "overlap"),
    ("forged_ratio", "more than deflate can produce"), ("bzip2_member", "compression method"),
    ("huge_shape_member", "declares shape (68719476736,)"), ("not_npy_member", "key canary"),
    ("pickled_member", "object (pickled) arrays are refused"),
    ("dir_huge_shape", "declares shape (1099511627776,)"), ("dir_pickled", "object"),
    ("dir_seq_len_flip", "seq_lens[0] = 4194310 is more than twice req_to_token's width 8"),
    ("dir_bad_unicode", "key launch_tag: holds an invalid string"),
    # The renamed member is an unknown key: refused, shown escaped, with the nearest name.
    ("control_name", "key \\nanary: not a dump key (did you mean canary?"),
    ("st_huge_length", "declares 1099511627776 bytes of JSON"),
    ("st_json_list", "not a JSON object"),
    ("wide_empty_table", "is outside req_to_token, which has 0 rows"),
    ("paged_huge_block", "key block_size: must be at most 65536"),
    ("dir_link_outside", "key seq_lens: is a link leaving the dump directory"),
    ("dir_bad_magic", "not a .npy file: it does not start with the .npy magic number"),
    ("st_big_header", "above the limit of 1048576"),
])
def test_hostile_files_are_refused_for_the_right_reason_without_allocating(corpus, label,
                                                                           fragment):
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(DumpError) as caught:
            load(corpus[label])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert fragment in str(caught.value)
    assert peak < 64 << 20, f"{label}: load allocated {peak} bytes before refusing"


def test_random_corruptions_through_the_command_never_crash(originals, tmp_path):
    """A batch of random corruptions in one audit run: every dump is audited or refused
    with a line naming it; no traceback; no file changes."""
    import random

    rng = random.Random(7)
    paths = []
    for index in range(int(os.environ.get("KVCANARY_FUZZ_CLI_FILES", "24"))):
        flavour = FLAVOURS[index % 3]
        files = dict(originals[flavour])
        file = rng.choice(sorted(files))
        data = bytearray(files[file])
        regions = header_regions(bytes(data))
        begin, end = rng.choice(regions)
        data[rng.randrange(begin, max(begin + 1, end))] ^= 1 << rng.randrange(8)
        files[file] = bytes(data)
        paths.append(materialise(tmp_path, flavour, files, name=f"r{index}"))
    before = [digest(p) for p in paths]
    result = run_audit(paths, "--format", "json", "-j", "2")
    assert result.returncode in (0, 1, 2), result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    for line in result.stderr.strip().splitlines():
        assert line.startswith("kvcanary: error: ") and any(p in line for p in paths), line
    assert [digest(p) for p in paths] == before


def test_npy_whose_header_leaves_the_data_misaligned_still_audits(tmp_path):
    """A .npy header two bytes short of numpy's padding (found by the load fuzz) puts the
    memory-mapped data at an odd address; load hands out aligned copies so the launches,
    which refuse misaligned arrays, still run."""
    arrays = dump_arrays()
    path = tmp_path / "d"
    save(path, **arrays)
    for key in ("canary", "seq_lens"):
        npy = npy_bytes(arrays[key])
        (length,) = struct.unpack("<H", npy[8:10])
        header = npy[10:10 + length - 3] + b"\n"   # two padding spaces fewer
        (path / f"{key}.npy").write_bytes(npy[:8] + struct.pack("<H", len(header)) + header
                                          + npy[10 + length:])
    dump = load(str(path))
    assert dump.canary.__array_interface__["data"][0] % 8 == 0
    assert dump.seq_lens.__array_interface__["data"][0] % 8 == 0
    np.testing.assert_array_equal(dump.canary, arrays["canary"])
    assert audit(dump, backend="numpy").entries_checked == 11
