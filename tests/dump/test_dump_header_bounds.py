"""What a dump's headers claim costs nothing before it is checked: a ``.npy`` header that
declares gigabytes is refused before it is read, and a ``user_``/``synth_`` member the audit
never uses is never decompressed (it is read when someone asks for it)."""

from __future__ import annotations

import os
import tracemalloc
import zipfile

import numpy as np
import pytest

from kvcanary.audit import audit
from kvcanary.dump import DumpError, load, save


def small_dump(path) -> str:
    table = np.zeros((2, 4), np.int64)
    table[1] = [1, 2, 3, 4]
    return save(str(path), canary=np.zeros((5, 32), np.uint8), req_to_token=table,
                req_pool_indices=np.array([1]), seq_lens=np.array([4]))


def huge_header(declared: int = 1_500_000_000, held: int = 24 << 10) -> bytes:
    """A format-2.0 ``.npy`` whose header length field declares ``declared`` bytes, with
    ``held`` bytes after it (what a forged file holds)."""
    return b"\x93NUMPY\x02\x00" + declared.to_bytes(4, "little") + b" " * held


def peak_of(call):
    tracemalloc.start()
    try:
        try:
            call()
        except DumpError as exc:
            error = exc
        else:
            error = None
        return tracemalloc.get_traced_memory()[1], error
    finally:
        tracemalloc.stop()


def test_an_npz_member_declaring_a_huge_header_is_refused_before_it_is_read(tmp_path):
    path = small_dump(tmp_path / "d.npz")
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("user_note.npy", huge_header())
    peak, error = peak_of(lambda: load(path))
    assert error is not None and "key user_note" in str(error)
    assert "declares 1500000000 bytes, above the limit of 10000" in str(error)
    assert peak < 4 << 20, peak     # before: the declared 1.5 GB header read whole


def test_a_directory_file_declaring_a_huge_header_is_refused_before_it_is_read(tmp_path):
    path = small_dump(tmp_path / "d")
    with open(os.path.join(path, "user_note.npy"), "wb") as handle:
        handle.write(huge_header())
    peak, error = peak_of(lambda: load(path))
    assert error is not None and "key user_note" in str(error) and "above the limit" in str(error)
    assert peak < 4 << 20, peak


@pytest.mark.parametrize("key", ["user_blob", "synth_blob"])
def test_an_unused_extra_member_is_not_decompressed(tmp_path, key):
    path = small_dump(tmp_path / "d.npz")
    blob = np.zeros(24 << 20, np.uint8)          # 24 MiB of zeros: ~24 KiB deflated
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, blob)
    assert os.path.getsize(path) < 1 << 20
    peak, error = peak_of(lambda: audit(load(path), backend="numpy"))
    assert error is None
    assert peak < 8 << 20, peak     # before: the member decompressed whole (24 MiB)
    dump = load(path)
    assert dump.extra[key].shape == blob.shape     # read on first access


def test_an_npz_with_two_members_of_one_name_is_refused(tmp_path):
    import warnings

    path = small_dump(tmp_path / "d.npz")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # zipfile warns of the duplicate name
        with zipfile.ZipFile(path, "a") as archive, archive.open("seq_lens.npy", "w") as member:
            np.lib.format.write_array(member, np.array([2]))
    with pytest.raises(DumpError, match="key seq_lens: the archive holds two members"):
        load(path)


def test_a_key_too_long_for_a_file_name_is_refused_before_any_folder_is_made(tmp_path):
    table = np.zeros((2, 4), np.int64)
    table[1] = [1, 2, 3, 4]
    with pytest.raises(DumpError, match="too long for a file name in a directory dump"):
        save(str(tmp_path / "out" / "d"), canary=np.zeros((5, 32), np.uint8),
             req_to_token=table, req_pool_indices=np.array([1]), seq_lens=np.array([4]),
             **{"user_" + "x" * 300: np.array(1)})
    assert list(tmp_path.iterdir()) == []        # before: an empty folder out/ was left
