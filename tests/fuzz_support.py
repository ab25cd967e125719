"""Shared pieces of the fuzz suites (tests/test_fuzz_*.py).

* ``fuzz_settings``: hypothesis settings with a fixed seed (``derandomize``), a per-example
  deadline and an example count from ``KVCANARY_FUZZ_EXAMPLES`` (the default keeps CI short;
  a long run sets e.g. ``KVCANARY_FUZZ_EXAMPLES=5000``).
* ``Guards``: arrays allocated inside a larger byte buffer whose head and tail hold a canary
  pattern; ``check`` fails when anything wrote outside the array it was given.
* ``hang_guard``: a hard stop for a launch that never returns (hypothesis' deadline only
  fires after an example finishes).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
from datetime import timedelta

import numpy as np
from hypothesis import HealthCheck, settings

GUARD_BYTES = 64
GUARD_PATTERN = 0xA5
HANG_SECONDS = 120


def fuzz_examples(default: int, share: int = 1) -> int:
    """``default``, or ``KVCANARY_FUZZ_EXAMPLES // share`` (at least 1) when that is set."""
    value = os.environ.get("KVCANARY_FUZZ_EXAMPLES")
    return max(1, int(value) // share) if value else default


def fuzz_settings(default_examples: int, deadline_ms: int = 5000, share: int = 1):
    return settings(max_examples=fuzz_examples(default_examples, share), derandomize=True,
                    database=None, deadline=timedelta(milliseconds=deadline_ms),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture,
                                           HealthCheck.filter_too_much])


class Guards:
    """Allocator of guarded arrays; every array it hands out is checked by ``check``.

    Under the sanitizer build (``KVCANARY_HARNESS_SANITIZE=1``) each array is instead its
    own allocation ending exactly at its last byte, so AddressSanitizer's redzones border it
    and catch stray reads as well as writes."""

    def __init__(self, exact: bool | None = None):
        self._buffers = []
        self.exact = os.environ.get("KVCANARY_HARNESS_SANITIZE") == "1" if exact is None else exact

    def array(self, values, dtype, *, misalign: int = 0) -> np.ndarray:
        """A C-contiguous array holding ``values`` (cast like numpy's unsafe cast), with
        ``GUARD_BYTES`` of pattern before and after; ``misalign`` shifts its start."""
        values = np.asarray(values)
        dtype = np.dtype(dtype)
        if values.dtype != dtype:
            values = _cast(values, dtype)
        nbytes = values.size * dtype.itemsize
        guard = 0 if self.exact else GUARD_BYTES
        begin = guard + misalign
        backing = np.full(begin + nbytes + guard, GUARD_PATTERN, dtype=np.uint8)
        inner = backing[begin:begin + nbytes].view(dtype).reshape(values.shape)
        inner[...] = values
        if not self.exact:
            self._buffers.append((backing, begin, nbytes))
        return inner

    def strided(self, values, dtype) -> np.ndarray:
        """The same values as a view with every other element of the last axis."""
        values = np.asarray(values)
        doubled = np.repeat(values, 2, axis=-1) if values.ndim else values
        return self.array(doubled, dtype)[..., ::2] if values.ndim else self.array(values, dtype)

    def check(self) -> None:
        for backing, begin, nbytes in self._buffers:
            head, tail = backing[:begin], backing[begin + nbytes:]
            if not ((head == GUARD_PATTERN).all() and (tail == GUARD_PATTERN).all()):
                where = "before" if not (head == GUARD_PATTERN).all() else "after"
                raise AssertionError(f"a launch wrote {where} an array of {nbytes} bytes "
                                     "(guard bytes changed)")


def _cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if values.dtype.kind in "iu" and dtype.kind in "iu":
        return values.astype(np.int64).astype(dtype)  # wraps like the C cast
    return values.astype(dtype)


@contextlib.contextmanager
def hang_guard(seconds: int = HANG_SECONDS):
    """Dump every thread's stack and exit the process if the block runs past ``seconds``."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
