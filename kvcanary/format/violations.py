"""Decoded violation rows and their renderings: upstream's frozen log line and block
(docs/format.md §11) and a JSON-ready dict."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .consts import TOKEN_FAIL_BITS, VIOLATION_FIELDS, WRITE_FAIL_BITS, FailReason, LaunchTag
from .errors import CanaryError

_MASK64 = (1 << 64) - 1


def tag_name(kernel_kind: int) -> str:
    try:
        return LaunchTag(int(kernel_kind)).name
    except ValueError:
        return f"unknown({int(kernel_kind)})"


def canary_kind(kernel_kind: int) -> str:
    """``sweep_k_full`` for sweep tags, ``per_forward_head_k_full`` for the others."""
    try:
        name = LaunchTag(int(kernel_kind)).name.lower()
    except ValueError:
        return f"unknown({int(kernel_kind)})"
    return name if name.startswith("sweep_") else f"per_forward_{name}"


def reason_label(bit: FailReason) -> str:
    """Member name lower-cased, a trailing ``_mismatch`` removed (upstream's labels)."""
    name = bit.name.lower()
    return name[: -len("_mismatch")] if name.endswith("_mismatch") else name


_LABELS = {int(member): reason_label(member) for member in FailReason}


def reason_labels(bits: int) -> list[str]:
    """Labels of the set bits in bit order; unknown bits as ``bit{n}``."""
    bits = int(bits) & ((1 << 64) - 1)
    labels = []
    while bits:
        low = bits & -bits
        labels.append(_LABELS.get(low) or f"bit{low.bit_length() - 1}")
        bits ^= low
    return labels


def hex64(value: int) -> str:
    return f"{int(value) & _MASK64:#018x}"


@dataclass(frozen=True)
class Violation:
    """One ring row (docs/format.md §10). ``position`` is the stored position on the verify path and
    the written one on the write path; ``expected_aux`` is the expected chain hash (verify),
    the expected position (write), or the offending index (``SLOT_OUT_OF_RANGE`` rows)."""

    kernel_kind: int
    slot_idx: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    fail_reason_bits: int

    @classmethod
    def from_row(cls, row) -> "Violation":
        values = [int(v) for v in np.asarray(row, dtype=np.int64).reshape(-1)]
        if len(values) != VIOLATION_FIELDS:
            raise CanaryError(f"a violation row has {VIOLATION_FIELDS} fields, got {len(values)}")
        return cls(*values)

    def to_row(self) -> np.ndarray:
        return np.array(
            [self.kernel_kind, self.slot_idx, self.position, self.stored_token,
             self.expected_token, self.stored_chain_hash, self.expected_aux,
             self.fail_reason_bits],
            dtype=np.int64,
        )

    @property
    def launch_tag(self) -> str:
        return tag_name(self.kernel_kind)

    @property
    def fail_reason(self) -> FailReason:
        return FailReason(self.fail_reason_bits & sum(FailReason))

    @property
    def labels(self) -> list[str]:
        return reason_labels(self.fail_reason_bits)

    @property
    def fail_reason_text(self) -> str:
        return "+".join(self.labels) or "none"

    def log_line(self, at: str | None = None) -> str:
        """Upstream's frozen structured line (tests parse it). ``at``, when the row's
        request and position are known (e.g. :meth:`kvcanary.LaunchFinding.where`), adds a
        second line ``  at: <at>``; the first line stays the frozen one."""
        if at:
            return f"{self.log_line()}\n  at: {at}"
        return (
            f"kv_canary violation: launch_tag={self.launch_tag} "
            f"fail_reason={self.fail_reason_text} slot_idx={self.slot_idx} "
            f"position={self.position} stored_token={self.stored_token} "
            f"expected_token={self.expected_token} "
            f"stored_chain_hash={hex64(self.stored_chain_hash)} "
            f"expected_aux={hex64(self.expected_aux)}"
        )

    def format_block(self, *, total_violations: int, ring_overflow: bool, step_when_pumped: int) -> str:
        """Upstream's multi-line report of one row (docs/format.md §11)."""
        labels = " ".join(self.labels) or "none"
        lines = [
            self.log_line(),
            f"KV cache canary violation detected (kernel_kind={self.launch_tag}, "
            f"slot_idx={self.slot_idx}, position={self.position})",
            f"canary_kind:       {canary_kind(self.kernel_kind)}",
            f"  fail_reasons: {labels}",
        ]
        stored_hash = hex64(self.stored_chain_hash)
        if self.fail_reason_bits & WRITE_FAIL_BITS:
            lines.append(
                f"  actual:   token_id={self.stored_token}   position={self.position} "
                f"prev_hash={stored_hash}"
            )
            lines.append(f"  expected: token_id={self.expected_token}   position={self.expected_aux}")
        else:
            lines.append(
                f"  stored:   token_id={self.stored_token}   position={self.position} "
                f"prev_hash={stored_hash}"
            )
            if self.fail_reason_bits & TOKEN_FAIL_BITS:
                lines.append(
                    f"  expected: token_id={self.expected_token} prev_hash={hex64(self.expected_aux)}"
                )
            else:
                lines.append(f"  expected: prev_hash={hex64(self.expected_aux)}")
        lines.append(
            f"  total_violations={total_violations} ring_overflow={ring_overflow} "
            f"step_when_pumped={step_when_pumped}"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "launch_tag": self.launch_tag,
            "fail_reason": self.fail_reason_text,
            "fail_reason_bits": self.fail_reason_bits,
            "slot_idx": self.slot_idx,
            "position": self.position,
            "stored_token": self.stored_token,
            "expected_token": self.expected_token,
            "stored_chain_hash": hex64(self.stored_chain_hash),
            "expected_aux": hex64(self.expected_aux),
        }
