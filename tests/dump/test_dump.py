"""Dump format v1: round trips of every container and the validation of bad dumps."""

from __future__ import annotations

import json
import os
import struct
import sys
import zipfile

import numpy as np
import pytest

import skip_reasons

from kvcanary import LaunchTag, RealKvHashMode
from kvcanary.dump import DumpError, load, save

from builders import DLPackOnly

FLAVOURS = ("npz", "dir", "safetensors")


def _path(tmp_path, flavour, name="d"):
    return str(tmp_path / (name if flavour == "dir" else f"{name}.{flavour}"))


def full_arrays():
    rng = np.random.default_rng(1)
    return dict(
        canary=rng.integers(0, 255, size=(16, 32), dtype=np.uint8),
        req_to_token=rng.integers(1, 16, size=(3, 8)).astype(np.int32),
        req_pool_indices=np.array([1, 2], dtype=np.int64),
        seq_lens=np.array([4, 8], dtype=np.int64),
        launch_tag="TAIL_K_SWA",
        real_kv_0=rng.standard_normal((16, 16)).astype(np.float16),
        real_kv_1=rng.integers(0, 255, size=(4, 4 * 48), dtype=np.uint8),
        real_kv_params=np.array([[1, 32, 32], [4, 48, 32]], dtype=np.int64),
        real_kv_hash_mode="partial",
        swa_window_size=6,
        full_to_swa_index_mapping=np.arange(16, dtype=np.int64),
        expected_tokens=rng.integers(0, 100, size=(3, 8)).astype(np.int32),
        expected_tokens_valid_lens=np.array([4, 8], dtype=np.int64),
        sweep_slot_indices=np.array([3, 4], dtype=np.int64),
        sweep_prev_slot_indices=np.array([-1, 3], dtype=np.int64),
        sweep_positions=np.array([0, 1], dtype=np.int64),
        synth_note="hello",
        synth_numbers=np.array([1, 2, 3], dtype=np.int64),
    )


def minimal():
    return dict(canary=np.zeros((8, 32), np.uint8), req_to_token=np.zeros((2, 4), np.int32),
                req_pool_indices=np.array([1], np.int64), seq_lens=np.array([2], np.int64))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_round_trip_every_key(tmp_path, flavour):
    arrays = full_arrays()
    path = save(_path(tmp_path, flavour), **arrays)
    d = load(path)
    assert d.flavour == flavour
    np.testing.assert_array_equal(d.canary, arrays["canary"])
    for key in ("req_to_token", "req_pool_indices", "seq_lens", "full_to_swa_index_mapping",
                "expected_tokens", "expected_tokens_valid_lens", "sweep_slot_indices",
                "sweep_prev_slot_indices", "sweep_positions", "real_kv_params"):
        got = getattr(d, key)
        np.testing.assert_array_equal(got, arrays[key])
        assert got.dtype == arrays[key].dtype
    assert d.launch_tag == LaunchTag.TAIL_K_SWA
    assert d.real_kv_hash_mode == RealKvHashMode.PARTIAL
    assert d.swa_window_size == 6
    # Sources come back as bytes: the float16 source's last dim doubles.
    assert d.real_kv[0].dtype == np.uint8 and d.real_kv[0].shape == (16, 32)
    assert d.real_kv[0].tobytes() == arrays["real_kv_0"].tobytes()
    assert d.real_kv[1].shape == (4, 192)
    assert d.extra["synth_note"] == "hello"
    np.testing.assert_array_equal(d.extra["synth_numbers"], [1, 2, 3])


def test_directory_is_memory_mapped_read_only(tmp_path):
    path = save(str(tmp_path / "d"), **full_arrays())
    d = load(path)
    assert isinstance(d.canary, np.memmap) or isinstance(d.canary.base, np.memmap)
    assert not d.canary.flags.writeable
    assert not d.req_to_token.flags.writeable


def test_int64_canary_is_accepted(tmp_path):
    arrays = minimal()
    arrays["canary"] = np.arange(32, dtype=np.int64).reshape(8, 4)
    d = load(save(str(tmp_path / "c.npz"), **arrays))
    assert d.canary.dtype == np.uint8 and d.canary.shape == (8, 32)
    assert d.canary.view("<i8")[1, 0] == 4


def test_save_accepts_dlpack_and_array_protocol_objects(tmp_path):
    class ArrayOnly:
        def __init__(self, array):
            self._array = array

        def __array__(self, dtype=None, copy=None):
            return self._array

    arrays = minimal()
    arrays["canary"] = DLPackOnly(np.full((8, 32), 7, np.uint8))
    arrays["req_to_token"] = ArrayOnly(np.ones((2, 4), np.int32))
    d = load(save(str(tmp_path / "x.npz"), **arrays))
    assert int(d.canary[3, 3]) == 7 and int(d.req_to_token[1, 1]) == 1


def _write_safetensors(path, tensors: dict, metadata: dict):
    """A .safetensors file by hand, for dtypes numpy cannot produce."""
    header, blobs, offset = {}, [], 0
    for key, (dtype, shape, data) in tensors.items():
        header[key] = {"dtype": dtype, "shape": list(shape),
                       "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = metadata
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def test_safetensors_bf16_and_fp8_sources_read_as_bytes(tmp_path):
    pytest.importorskip("safetensors", reason=skip_reasons.SAFETENSORS)
    base = minimal()
    tensors = {key: ({np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32",
                      np.dtype(np.int64): "I64"}[value.dtype], value.shape, value.tobytes())
               for key, value in base.items()}
    tensors["kvcanary_dump_version"] = ("I64", (), np.int64(1).tobytes())
    bf16 = np.arange(8 * 16, dtype=np.uint16).reshape(8, 16)
    tensors["real_kv_0"] = ("BF16", (8, 16), bf16.tobytes())
    fp8 = np.arange(8 * 32, dtype=np.uint8).reshape(8, 32)
    tensors["real_kv_1"] = ("F8_E4M3", (8, 32), fp8.tobytes())
    tensors["real_kv_params"] = ("I64", (2, 3), np.array([[1, 32, 32], [1, 32, 16]]).tobytes())
    path = str(tmp_path / "raw.safetensors")
    _write_safetensors(path, tensors, {"real_kv_hash_mode": "all"})
    d = load(path)
    assert d.real_kv[0].shape == (8, 32) and d.real_kv[0].tobytes() == bf16.tobytes()
    assert d.real_kv[1].shape == (8, 32) and d.real_kv[1].tobytes() == fp8.tobytes()
    assert d.real_kv_hash_mode == RealKvHashMode.ALL


def test_missing_safetensors_package_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(DumpError, match=r"x\.safetensors.*pip install safetensors"):
        save(str(tmp_path / "x.safetensors"), **minimal())


# ---------------------------------------------------------------------------- bad dumps


def _expect(path, *fragments):
    with pytest.raises(DumpError) as info:
        load(path)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def raw_save(path: str, **arrays) -> str:
    """Write ``arrays`` (plus the version key) in the container the path names, without
    save's checks: the file load must refuse."""
    values = {"kvcanary_dump_version": np.array(1, np.int64)}
    values.update({key: np.asarray(value) for key, value in arrays.items()})
    if path.endswith(".npz"):
        np.savez(path, **values)
    elif path.endswith(".safetensors"):
        from safetensors.numpy import save_file

        save_file({k: v for k, v in values.items() if v.dtype.kind != "U"}, path,
                  metadata={k: str(v) for k, v in values.items() if v.dtype.kind == "U"} or None)
    else:
        os.makedirs(path)
        for key, value in values.items():
            np.save(os.path.join(path, f"{key}.npy"), value)
    return path


def _refused_alike(path: str, arrays: dict, *fragments):
    """save refuses ``arrays`` and writes nothing; load refuses the same arrays written
    raw, with the same message: one checker."""
    with pytest.raises(DumpError) as info:
        save(path, **arrays)
    assert not os.path.exists(path)
    assert _expect(raw_save(path, **arrays), path, *fragments) == str(info.value)


@pytest.mark.parametrize("key", ["canary", "req_to_token", "req_pool_indices", "seq_lens"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_missing_required_key(tmp_path, flavour, key):
    arrays = minimal()
    del arrays[key]
    _refused_alike(_path(tmp_path, flavour), arrays, f"key {key}", "missing")


@pytest.mark.parametrize("key,value,fragment", [
    ("seq_lens", np.array([2.0]), "dtype must be int64"),
    ("req_pool_indices", np.array([1], np.uint64), "dtype must be int64"),
    ("canary", np.zeros((8, 32), np.float32), "dtype must be uint8"),
    ("canary", np.zeros((10, 31), np.uint8), "slot stride"),
    ("req_to_token", np.zeros((2, 4), np.float64), "dtype must be int32 or int64"),
    ("canary", np.zeros((8, 16), np.uint8), "slot stride"),
    ("canary", np.zeros((8, 3), np.int64), "dim 1 must be 4"),
    ("seq_lens", np.array([1, 2], np.int64), "dim 0 must be 1"),
    ("req_to_token", np.zeros(4, np.int32), "must be 2-D"),
    ("seq_lens", np.array([-3], np.int64), "negative"),
    ("req_pool_indices", np.array([-1], np.int64), "negative"),
    ("kvcanary_dump_version", np.array(2, np.int64), "unsupported dump version"),
    ("launch_tag", "TAIL_Q_FULL", "unknown launch tag"),
])
def test_invalid_values(tmp_path, key, value, fragment):
    arrays = minimal()
    arrays[key] = value
    _refused_alike(str(tmp_path / "bad.npz"), arrays, f"key {key}", fragment)


def test_inconsistent_optional_groups(tmp_path):
    cases = [
        (dict(real_kv_0=np.zeros((8, 32), np.uint8)), "key real_kv_params", "missing"),
        (dict(real_kv_0=np.zeros((8, 32), np.uint8), real_kv_params=np.array([[1, 32, 32]])),
         "key real_kv_hash_mode", "missing"),
        (dict(real_kv_0=np.zeros((8, 32), np.uint8), real_kv_params=np.array([[1, 32, 32]]),
              real_kv_hash_mode="most"), "key real_kv_hash_mode", "must be none, partial or all"),
        (dict(real_kv_0=np.zeros((8, 32), np.uint8), real_kv_params=np.array([[1, 24, 16]]),
              real_kv_hash_mode="all"), "key real_kv_params[0]", "multiple of 16"),
        (dict(swa_window_size=4), "key full_to_swa_index_mapping", "missing"),
        (dict(expected_tokens=np.zeros((2, 4), np.int32)), "key expected_tokens_valid_lens"),
        (dict(expected_tokens=np.zeros((3, 4), np.int32),
              expected_tokens_valid_lens=np.array([2], np.int64)),
         "key expected_tokens", "dim 0 must be 2"),
        (dict(sweep_slot_indices=np.array([1], np.int64)), "key sweep_prev_slot_indices",
         "missing"),
    ]
    for index, (extra, *fragments) in enumerate(cases):
        _refused_alike(str(tmp_path / f"{index}.npz"), dict(minimal(), **extra), *fragments)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_narrower_integers_are_widened_alike_on_save_and_load(tmp_path, flavour):
    narrow = dict(minimal(), req_pool_indices=np.array([1], np.int32),
                  seq_lens=np.array([2], np.uint16),
                  sweep_slot_indices=np.array([3], np.int32),
                  sweep_prev_slot_indices=np.array([-1], np.int8),
                  sweep_positions=np.array([0], np.uint32),
                  real_kv_0=np.zeros((8, 32), np.uint8),
                  real_kv_params=np.array([[1, 32, 32]], np.int32), real_kv_hash_mode="none")
    saved = load(save(_path(tmp_path, flavour, "saved"), **narrow))
    raw = load(raw_save(_path(tmp_path, flavour, "raw"), **narrow))
    for d in (saved, raw):
        for key in ("req_pool_indices", "seq_lens", "sweep_slot_indices",
                    "sweep_prev_slot_indices", "sweep_positions", "real_kv_params"):
            value = getattr(d, key)
            assert value.dtype == np.int64, key
            np.testing.assert_array_equal(value, narrow[key])
    # What a written file holds is already int64: the widening happened before writing.
    if flavour == "dir":
        assert np.load(tmp_path / "saved" / "seq_lens.npy").dtype == np.int64


def test_save_refuses_an_unreadable_dump_before_writing_anything(tmp_path):
    directory = tmp_path / "out"
    with pytest.raises(DumpError, match=r"out: key launch_tag: unknown launch tag"):
        save(str(directory), **dict(minimal(), launch_tag="nope"))
    assert not directory.exists()


def test_object_arrays_are_refused(tmp_path):
    arrays = {k: v for k, v in minimal().items()}
    arrays["kvcanary_dump_version"] = np.array(1, np.int64)
    arrays["seq_lens"] = np.array([object()], dtype=object)
    path = str(tmp_path / "obj.npz")
    np.savez(path, **arrays)  # numpy pickles the object array
    _expect(path, "obj.npz", "key seq_lens", "object")
    directory = tmp_path / "objdir"
    directory.mkdir()
    for key, value in arrays.items():
        np.save(directory / f"{key}.npy", value, allow_pickle=True)
    _expect(str(directory), "seq_lens.npy", "key seq_lens", "object")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_truncated_files(tmp_path, flavour):
    path = save(_path(tmp_path, flavour), **dict(minimal(), canary=np.ones((4096, 32), np.uint8)))
    target = path if flavour != "dir" else str(tmp_path / "d" / "canary.npy")
    with open(target, "rb") as handle:
        data = handle.read()
    with open(target, "wb") as handle:
        handle.write(data[: len(data) // 2])
    message = _expect(path)
    assert ("canary" in message) or (path in message)


def test_not_a_dump(tmp_path):
    _expect(str(tmp_path / "nothing.npz"), "nothing.npz", "no such file")
    (tmp_path / "x.txt").write_text("hello")
    _expect(str(tmp_path / "x.txt"), "unknown dump container")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    _expect(str(tmp_path / "junk.npz"), "junk.npz")
    with zipfile.ZipFile(tmp_path / "empty.npz", "w"):
        pass
    _expect(str(tmp_path / "empty.npz"), "empty.npz: not a kvcanary dump: it lacks the required "
            "key(s) kvcanary_dump_version, canary, req_to_token, req_pool_indices, seq_lens")
    (tmp_path / "photos").mkdir()
    np.save(tmp_path / "photos" / "canary.npy", np.zeros((8, 32), np.uint8))
    _expect(str(tmp_path / "photos"), "not a kvcanary dump", "kvcanary_dump_version, "
            "req_to_token, req_pool_indices, seq_lens")


def test_directory_dump_replaces_an_earlier_dump_only(tmp_path):
    directory = str(tmp_path / "d")
    save(directory, **full_arrays())
    save(directory, **minimal())          # fewer keys: the earlier dump's extras go
    d = load(directory)
    assert d.real_kv == () and d.expected_tokens is None and "synth_note" not in d.extra
    other = tmp_path / "other"
    other.mkdir()
    np.save(other / "mine.npy", np.zeros(3))
    with pytest.raises(DumpError, match="not a kvcanary dump"):
        save(str(other), **minimal())
    assert (other / "mine.npy").exists()


def test_save_and_load_say_what_they_take_and_refuse():
    import kvcanary.dump

    for function, words in ((kvcanary.dump.save, ["__dlpack__", "cupy", "Refuses", "DumpError",
                                                 "widened", "docs/dump-format.md"]),
                            (kvcanary.dump.load, ["Refuses", "DumpError", "not a kvcanary dump",
                                                 "Never writes"])):
        for word in words:
            assert word in function.__doc__, (function.__name__, word)


def test_npy_format_3_is_refused_by_name(tmp_path):
    """Only numpy.lib.format's public header readers are used: 1.0 and 2.0."""
    from numpy.lib import format as npy_format

    directory = tmp_path / "d"
    save(str(directory), **minimal())
    with open(directory / "seq_lens.npy", "wb") as handle:
        npy_format.write_array(handle, np.array([2], np.int64), version=(3, 0))
    _expect(str(directory), "key seq_lens", ".npy format version 3.0 is not supported")


def _minimal_dump():
    table = np.zeros((2, 4), np.int32)
    table[1, 0] = 1
    return dict(canary=np.zeros((4, 32), np.uint8), req_to_token=table,
                req_pool_indices=np.array([1], np.int64), seq_lens=np.array([0], np.int64))


def test_save_refuses_a_misspelt_key_naming_the_nearest_one(tmp_path):
    path = tmp_path / "d.npz"
    with pytest.raises(DumpError, match=r"key expected_token: not a dump key \(did you mean "
                                        r"expected_tokens\? keys of your own start with user_"):
        save(str(path), expected_token=np.zeros((2, 4), np.int64), **_minimal_dump())
    assert not path.exists()
    with pytest.raises(DumpError, match=r"key frobnicate: not a dump key \(keys of your own"):
        save(str(path), frobnicate=1, **_minimal_dump())


def test_keys_of_the_users_own_are_saved_and_carried_through(tmp_path):
    path = save(str(tmp_path / "d.npz"), user_step=np.array(1234), user_model="m",
                **_minimal_dump())
    dump = load(path)
    assert int(dump.extra["user_step"]) == 1234 and dump.string("user_model") == "m"


def _hand_made(tmp_path, **changes):
    """A dump written with np.savez by hand (no kvcanary.dump.save), as a newcomer would."""
    from builders import i64

    from kvcanary.dump import save

    path = save(str(tmp_path / "base.npz"), canary=np.zeros((8, 32), np.uint8),
                req_to_token=np.zeros((2, 4), np.int32), req_pool_indices=i64([1]),
                seq_lens=i64([2]))
    with np.load(path) as z:
        values = dict(z)
    values.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del values[key]
    out = tmp_path / "hand.npz"
    np.savez(out, **values)
    return str(out)


def test_a_misspelt_key_in_a_hand_made_dump_is_refused_with_the_nearest_name(tmp_path):
    from kvcanary.dump import DumpError, load

    path = _hand_made(tmp_path, expected_token=np.zeros((2, 4), np.int64))
    with pytest.raises(DumpError, match="key expected_token: not a dump key .did you mean "
                                        "expected_tokens"):
        load(path)


def test_a_key_required_by_another_says_which_and_the_fix(tmp_path):
    from kvcanary.dump import DumpError, load

    path = _hand_made(tmp_path, expected_tokens_valid_lens=np.array([2], np.int64))
    with pytest.raises(DumpError, match="key expected_tokens: missing .required with "
                                        "expected_tokens_valid_lens, which is present: add it "
                                        "or drop expected_tokens_valid_lens"):
        load(path)


def test_a_dump_without_its_version_key_says_how_to_make_one(tmp_path):
    from kvcanary.dump import DumpError, load

    path = _hand_made(tmp_path, kvcanary_dump_version=None)
    with pytest.raises(DumpError, match="kvcanary.dump.save.*kvcanary_dump_version = 1"):
        load(path)


def test_a_lone_npy_is_called_one_key_of_a_directory_dump(tmp_path):
    from kvcanary.dump import DumpError, load

    np.save(tmp_path / "seq_lens.npy", np.arange(3))
    with pytest.raises(DumpError, match="a lone .npy file is one key of a directory dump"):
        load(str(tmp_path / "seq_lens.npy"))
