"""Opening ``explain``'s inputs: text logs only, read as bytes in bounded chunks.

A file is looked at before it is read: a kvcanary dump (npz, npy, safetensors, a directory)
is refused naming ``kvcanary audit``, and any other file whose first bytes hold a NUL is
refused as binary (``/dev/zero`` would otherwise be one endless line). Lines are cut at
``limit`` characters: the rest of a longer line is skimmed in chunks for the marks of a
violation report and comes back as one :class:`kvcanary.audit.explain.Overlong`, so memory stays
bounded by the limit and time by the bytes.
"""

from __future__ import annotations

import os
import stat

from kvcanary.audit.explain_parse import VIOLATION_MARKS, ExplainError, Overlong

SNIFF_BYTES = 8192
CHUNK_BYTES = 1 << 16
_MARKS = tuple(mark.encode() for mark in VIOLATION_MARKS)
_OVERLAP = max(len(mark) for mark in _MARKS) - 1
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_NPY_MAGIC = b"\x93NUMPY"
_AUDIT = "read a dump with `kvcanary audit`; `explain` reads logs"


def _safetensors(head: bytes) -> bool:
    if len(head) < 10:
        return False
    header_len = int.from_bytes(head[:8], "little")
    return 2 <= header_len < 1 << 27 and head[8:9] == b"{"


def refuse_binary(head: bytes, shown: str) -> None:
    """Raise :class:`ExplainError` if ``head`` (a file's first bytes) is not a text log."""
    if head.startswith(_ZIP_MAGIC):
        raise ExplainError(f"{shown}: a zip archive (an .npz dump?), not a log: {_AUDIT}")
    if head.startswith(_NPY_MAGIC):
        raise ExplainError(f"{shown}: a .npy array (one key of a directory dump?), not a "
                           f"log: {_AUDIT}")
    if _safetensors(head):
        raise ExplainError(f"{shown}: a safetensors file (a dump?), not a log: {_AUDIT}")
    if b"\0" in head:
        raise ExplainError(f"{shown}: a binary file (NUL bytes in its first "
                           f"{len(head)} bytes), not a text log")


def open_log(path: str, stdin_buffer=None):
    """``(stream, head)``: ``path`` opened for binary reading (``-``: ``stdin_buffer``) and its
    first bytes, already read and checked by :func:`refuse_binary`."""
    if path == "-":
        stream = stdin_buffer
        shown = "<stdin>"
    else:
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise ExplainError(f"{path}: {exc.strerror or exc}") from None
        if stat.S_ISDIR(mode):
            raise ExplainError(f"{path}: a directory, not a log (a directory dump? {_AUDIT})")
        try:
            stream = open(path, "rb")   # noqa: SIM115 (closed by the caller)
        except OSError as exc:
            raise ExplainError(f"{path}: {exc.strerror or exc}") from None
        shown = path
    try:
        head = _read_at_most(stream, SNIFF_BYTES)
        refuse_binary(head, shown)
    except BaseException:
        if path != "-":
            stream.close()
        raise
    return stream, head


def _read_at_most(stream, size: int) -> bytes:
    parts, got = [], 0
    while got < size:
        part = stream.read(size - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def log_lines(stream, head: bytes, limit: int):
    """The lines of ``head`` followed by the rest of ``stream`` (bytes), decoded as UTF-8
    (bad bytes replaced), without their line ends; a line over ``limit`` bytes comes back as
    an :class:`Overlong` (whose ``canary`` says whether a violation mark was in it)."""
    buf, pos, eof = head, 0, False
    while True:
        nl = buf.find(b"\n", pos)
        if nl < 0 and not eof and len(buf) - pos <= limit:
            more = stream.read(CHUNK_BYTES)
            if more:
                buf, pos = buf[pos:] + more, 0
            else:
                eof = True
            continue
        if nl >= 0 and nl - pos <= limit:
            yield _decode(buf[pos:nl]).rstrip("\r")
            pos = nl + 1
            continue
        if nl < 0 and eof and len(buf) - pos <= limit:
            if pos < len(buf):
                yield _decode(buf[pos:]).rstrip("\r")
            return
        # An over-long line: skim it to its end for the marks, keeping only an overlap.
        canary = False
        while True:
            end = buf.find(b"\n", pos)
            piece = buf[pos:] if end < 0 else buf[pos:end]
            canary = canary or any(mark in piece for mark in _MARKS)
            if end >= 0:
                pos = end + 1
                break
            tail = buf[max(pos, len(buf) - _OVERLAP):]
            more = b"" if eof else stream.read(CHUNK_BYTES)
            if not more:
                buf, pos, eof = b"", 0, True
                break
            buf, pos = tail + more, 0
        yield Overlong(canary)
