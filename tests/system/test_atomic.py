"""Outputs are whole or absent: a write that fails or is interrupted leaves the previous
file (or nothing) and no temporary beside it."""

from __future__ import annotations

import os
import signal
import stat

import numpy as np
import pytest

import skip_reasons

from interrupt_harness import snapshot
from kvcanary.system.atomic import replacing
from kvcanary.dump import DumpError, load, save
from kvcanary.system.signals import Interrupted


def arrays(num_slots: int = 8, tag: str = "TAIL_K_FULL") -> dict:
    return dict(canary=np.zeros((num_slots, 32), np.uint8), req_to_token=np.zeros((2, 3), np.int32),
                req_pool_indices=np.zeros(0, np.int64), seq_lens=np.zeros(0, np.int64),
                launch_tag=tag)


def test_a_failed_write_leaves_the_previous_file(tmp_path):
    target = tmp_path / "report.txt"
    target.write_text("earlier")
    with pytest.raises(Interrupted):
        with replacing(target) as temporary, open(temporary, "w") as handle:
            handle.write("half of the new")
            raise Interrupted(signal.SIGINT)
    assert os.listdir(tmp_path) == ["report.txt"] and target.read_text() == "earlier"
    with replacing(target) as temporary, open(temporary, "w") as handle:
        handle.write("new")
    assert os.listdir(tmp_path) == ["report.txt"] and target.read_text() == "new"


def test_modes_follow_the_target_or_the_umask(tmp_path):
    umask = os.umask(0o027)
    try:
        with replacing(tmp_path / "new.txt"):
            pass
        with replacing(tmp_path / "new_dir", directory=True):
            pass
        kept = tmp_path / "kept.txt"
        kept.write_text("x")
        kept.chmod(0o604)
        with replacing(kept):
            pass
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "new.txt").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(tmp_path / "new_dir").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o604


def _interrupted_npz(handle, **values):
    handle.write(b"PK\x03\x04 half a zip")
    raise Interrupted(signal.SIGINT)


def _interrupted_safetensors(tensors, path, metadata=None):
    with open(path, "wb") as handle:
        handle.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    raise Interrupted(signal.SIGINT)


def _interrupted_after_first_npy(real):
    calls = []

    def save_npy(file, array, **kwargs):
        calls.append(file)
        if len(calls) > 1:   # the second file is cut short (a path, or a stream's writes)
            if hasattr(file, "write"):
                file.write(b"\x93NUMPY partial")
            else:
                with open(file, "wb") as handle:
                    handle.write(b"\x93NUMPY partial")
            raise Interrupted(signal.SIGTERM)
        real(file, array, **kwargs)

    return save_npy


@pytest.mark.parametrize("name", ["d.npz", "d.safetensors", "d"])
def test_an_interrupted_save_leaves_the_earlier_dump(name, tmp_path, monkeypatch):
    path = tmp_path / name
    if name.endswith(".safetensors"):
        safetensors_numpy = pytest.importorskip("safetensors.numpy",
                                                reason=skip_reasons.SAFETENSORS)
    save(path, **arrays(8, "HEAD_K_FULL"))
    before = snapshot(tmp_path)
    if name.endswith(".safetensors"):
        monkeypatch.setattr(safetensors_numpy, "save_file", _interrupted_safetensors)
    elif name.endswith(".npz"):
        monkeypatch.setattr(np, "savez", _interrupted_npz)
    else:
        monkeypatch.setattr(np, "save", _interrupted_after_first_npy(np.save))
    with pytest.raises(Interrupted):
        save(path, **arrays(16))
    monkeypatch.undo()
    assert snapshot(tmp_path) == before
    assert load(path).num_slots == 8


def test_directory_dump_refuses_a_directory_with_other_files(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(DumpError, match="notes.txt"):
        save(mine, **arrays())
    assert (mine / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(DumpError, match="not a directory"):
        save(tmp_path / "file", **arrays())
    empty = tmp_path / "empty"
    empty.mkdir()
    save(empty, **arrays())
    assert load(empty).num_slots == 8
    assert sorted(os.listdir(tmp_path)) == ["empty", "file", "mine"]



def test_a_link_is_followed_and_a_device_written_in_place(tmp_path):
    real = tmp_path / "real.txt"
    real.write_text("earlier")
    (tmp_path / "link.txt").symlink_to(real)
    with replacing(tmp_path / "link.txt") as temporary, open(temporary, "w") as handle:
        handle.write("new")
    assert (tmp_path / "link.txt").is_symlink() and real.read_text() == "new"
    with replacing(os.devnull) as temporary:
        assert temporary == os.devnull


def test_the_next_save_removes_what_a_killed_writer_left_and_says_so(tmp_path, capsys):
    import subprocess
    import sys

    import numpy as np

    from kvcanary.dump import save

    target = tmp_path / "d"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale_dir = tmp_path / f".d.{dead}.abc123.partial"       # a directory writer's, SIGKILLed
    stale_dir.mkdir()
    (stale_dir / "canary.npy").write_bytes(b"x" * 1000)
    live = tmp_path / f".d.{os.getpid()}.zzz.partial"        # a live writer's: left alone
    live.mkdir()
    table = np.zeros((2, 4), np.int64)
    table[1] = [1, 2, 3, 4]
    save(str(target), canary=np.zeros((5, 32), np.uint8), req_to_token=table,
         req_pool_indices=np.array([1]), seq_lens=np.array([4]))
    assert not stale_dir.exists() and live.exists()
    assert f"removed 1 partial output(s) of writers that died: .d.{dead}.abc123.partial" in \
        capsys.readouterr().err
