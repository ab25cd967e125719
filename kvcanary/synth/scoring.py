"""Ground truth against findings: read a dump's injected faults back and score each one at its
target entry."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..consts import REAL_KV_PARTIAL_READ_BYTES, RealKvHashMode
from .faults import FAULT_KINDS, Fault


@dataclass
class FaultOutcome:
    kind: str
    request_row: int
    position: int
    slot: int
    expected_bits: int
    visible: bool
    detected: bool
    fired_bits: int
    note: str = ""


def faults_from_dump(dump) -> list:
    """The ground truth a synth dump carries, as :class:`Fault` rows."""
    extra = dump.extra
    if "synth_fault_kind" not in extra:
        return []
    names = str(extra.get("synth_fault_kinds", ",".join(FAULT_KINDS))).split(",")
    get = lambda key: np.asarray(extra[f"synth_fault_{key}"]).astype(np.int64).tolist()  # noqa: E731
    return [Fault(kind=names[k], batch_index=b, request_row=r, position=p, slot=s,
                  expected_bits=e, visible=bool(v), detail=d)
            for k, b, r, p, s, e, v, d in zip(get("kind"), get("batch_index"), get("request_row"),
                                              get("position"), get("slot"), get("expected_bits"),
                                              get("visible"), get("detail"))]


def fault_note(fault: Fault, mode: RealKvHashMode, compat: bool = False) -> str:
    """Why a fault is or is not visible, in words."""
    if fault.kind == "real-kv-byte":
        if mode == RealKvHashMode.NONE:
            return "not visible in none mode (real KV bytes are not hashed)"
        if mode == RealKvHashMode.PARTIAL and fault.detail >= REAL_KV_PARTIAL_READ_BYTES:
            return (f"not visible in partial mode (byte {fault.detail} is outside the "
                    f"{REAL_KV_PARTIAL_READ_BYTES} bytes partial mode hashes)")
        return f"byte {fault.detail} of the slot's real KV"
    if fault.kind == "slot-zero":
        if compat:
            return "not visible with --compat (upstream skips slot 0 as unfilled)"
        return "seen by kvcanary's SLOT_ZERO_IN_PREFIX extension"
    if fault.kind == "swap":
        return f"positions {fault.position} and {fault.detail} exchanged"
    return fault.note


def score(faults, result) -> list:
    """Match injected faults against an audit result's findings (the target entry, and the
    exchanged entry of a swap)."""
    mode = RealKvHashMode[result.real_kv_hash_mode.upper()]
    outcomes = []
    for fault in faults:
        visible = fault.visible and not (fault.kind == "slot-zero" and result.compat)
        targets = [fault.position] + ([fault.detail] if fault.kind == "swap" else [])
        fired = 0
        for position in targets:
            for finding in result.findings_at(fault.request_row, position):
                fired |= finding.violation.fail_reason_bits
        detected = (fired & fault.expected_bits) == fault.expected_bits and fired != 0
        outcomes.append(FaultOutcome(kind=fault.kind, request_row=fault.request_row,
                                     position=fault.position, slot=fault.slot,
                                     expected_bits=fault.expected_bits, visible=visible,
                                     detected=detected, fired_bits=fired,
                                     note=fault_note(fault, mode, result.compat)))
    return outcomes
