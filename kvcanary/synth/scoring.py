"""Ground truth against findings: read a dump's injected faults back and score each one at its
sites, the verify entries it changed (every request row that maps a changed record, and the
prefix cache's sweep entry of it)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..format.consts import FailReason, RealKvHashMode
from .fault_kinds import (DEFAULT_TARGET, FAULT_KINDS, REQUEST, SWEEP, Fault, Site,
                          real_kv_byte_note)

_SLOT_ZERO = int(FailReason.SLOT_ZERO_IN_PREFIX)


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
    target: str = DEFAULT_TARGET
    sites: int = 0            # sites that must fire under these rules
    request_rows: int = 0     # distinct request rows among them


def faults_from_dump(dump) -> list:
    """The ground truth a synth dump carries, as :class:`Fault` rows."""
    extra = dump.extra
    if "synth_fault_kind" not in extra:
        return []
    names = str(extra.get("synth_fault_kinds", ",".join(FAULT_KINDS))).split(",")
    def get(key):
        return np.asarray(extra[f"synth_fault_{key}"]).astype(np.int64).tolist()

    faults = [Fault(kind=names[k], batch_index=b, request_row=r, position=p, slot=s,
                    expected_bits=e, visible=bool(v), detail=d)
              for k, b, r, p, s, e, v, d in zip(get("kind"), get("batch_index"),
                                                get("request_row"), get("position"), get("slot"),
                                                get("expected_bits"), get("visible"),
                                                get("detail"))]
    if "synth_fault_site_count" not in extra:
        # An older dump: each fault scored at its target entry (any slot), with its bits.
        for fault in faults:
            fault.sites = (Site(entry=REQUEST, request_row=fault.request_row,
                                position=fault.position, slot=-1, bits=fault.expected_bits),)
        return faults
    targets = str(extra["synth_fault_targets"]).split(",")
    site_rows = list(zip(get("site_sweep"), get("site_request_row"), get("site_position"),
                         get("site_slot"), get("site_bits")))
    begin = 0
    for fault, target, count in zip(faults, get("target"), get("site_count")):
        fault.target = targets[target]
        fault.sites = tuple(Site(entry=SWEEP if sweep else REQUEST, request_row=row,
                                 position=position, slot=slot, bits=bits)
                            for sweep, row, position, slot, bits in site_rows[begin:begin + count])
        begin += count
    return faults


def fault_note(fault: Fault, mode: RealKvHashMode, compat: bool = False) -> str:
    """Why a fault is or is not visible, in words."""
    if fault.kind == "real-kv-byte":
        return real_kv_byte_note(mode, fault.detail)
    if fault.kind == "slot-zero":
        if compat:
            return "not visible with --compat (upstream skips slot 0 as unfilled)"
        return "seen by kvcanary's SLOT_ZERO_IN_PREFIX extension"
    if fault.kind == "swap":
        return f"positions {fault.position} and {fault.detail} exchanged"
    return fault.note


def findings_by_entry(result) -> dict:
    """``(entry, request row or -1, position, slot) -> fired bits`` over an audit's findings;
    request findings are keyed by the slot they read, sweep findings too."""
    fired = defaultdict(int)
    for finding in result.findings:
        v = finding.violation
        row = finding.request_row if finding.kind == REQUEST else -1
        fired[(finding.kind, row, finding.position, v.slot_idx)] |= v.fail_reason_bits
    return fired


def _fired_at(fired: dict, site: Site) -> int:
    if site.slot >= 0:
        return fired.get((site.entry, site.request_row, site.position, site.slot), 0)
    return _union(bits for (entry, row, position, _), bits in fired.items()
                    if (entry, row, position) == (site.entry, site.request_row, site.position))


def _union(values) -> int:
    total = 0
    for value in values:
        total |= value
    return total


def score(faults, result) -> list:
    """Match injected faults against an audit result's findings: a fault is detected when at
    every one of its sites a finding of that entry (request row and position, or sweep
    position; and the slot the entry reads) fired the bits expected there."""
    mode = RealKvHashMode[result.real_kv_hash_mode.upper()]
    fired = findings_by_entry(result)
    outcomes = []
    for fault in faults:
        sites = [(site, site.bits & ~(_SLOT_ZERO if result.compat else 0))
                 for site in fault.sites]
        must = [(site, bits) for site, bits in sites if bits]
        got = [_fired_at(fired, site) for site, _ in sites]
        visible = fault.visible and bool(must)
        detected = visible and all((_fired_at(fired, site) & bits) == bits
                                   for site, bits in must)
        outcomes.append(FaultOutcome(
            kind=fault.kind, request_row=fault.request_row, position=fault.position,
            slot=fault.slot, expected_bits=_union(bits for _, bits in must), visible=visible,
            detected=detected, fired_bits=_union(got),
            note=fault_note(fault, mode, result.compat), target=fault.target, sites=len(must),
            request_rows=len({site.request_row for site, _ in must if site.entry == REQUEST})))
    return outcomes
