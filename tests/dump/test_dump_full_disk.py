"""A directory dump that cannot be written whole says why, naming the file: a full disk is
"No space left on device", a file-size limit "File too large", never numpy's short-write
count ("1048576 requested and 835456 written"), and nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="file-size limits and /dev/full: Linux only")

SAVE_UNDER_A_LIMIT = r"""
import os, resource, signal, sys
import numpy as np
from kvcanary.dump import save

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    save(sys.argv[1], canary=np.zeros((1 << 16, 32), np.uint8),
         req_to_token=np.ones((4, 64), np.int32), req_pool_indices=np.zeros(2, np.int64),
         seq_lens=np.zeros(2, np.int64))
except ValueError as exc:
    print(exc)
"""


def test_a_write_cut_short_is_named_by_its_file_and_its_cause(tmp_path):
    target = tmp_path / "d"
    done = subprocess.run([sys.executable, "-c", SAVE_UNDER_A_LIMIT, str(target)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{target}: cannot write the dump (canary.npy: File too large)\n"
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_no_space_left_on_device(tmp_path, monkeypatch):
    # Every key's file is opened on /dev/full, as on a disk with no room left.
    import builtins

    import numpy as np

    from kvcanary.dump import save

    real_open = builtins.open

    def full_open(file, mode="r", *args, **kwargs):
        if "w" in mode and str(file).endswith(".npy"):
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_open)
    with pytest.raises(ValueError, match=r"cannot write the dump \(\w+\.npy: No space left on "
                       r"device\)$"):
        save(str(tmp_path / "d"), canary=np.zeros((1 << 15, 32), np.uint8),
             req_to_token=np.ones((4, 64), np.int32), req_pool_indices=np.zeros(2, np.int64),
             seq_lens=np.zeros(2, np.int64))
    assert os.listdir(tmp_path) == []
