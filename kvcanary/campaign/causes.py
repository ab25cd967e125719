"""The campaign scores diagnoses as well as detection: for every fault the canary is designed
to see, each finding at a site where the fault must fire is counted under the cause its
diagnosis names (:mod:`kvcanary.diagnosis`), against the cause the injected fault is. A
finding that states a cause as certain and names another than the fault's is a failure of
the campaign: a diagnosis may only say certain when its evidence excludes every alternative.

Interacting pairs are counted but not held to that rule: at an entry two faults reach, the
truth is both at once (a position fault after a lost write is a changed predecessor too),
and a diagnosis names one cause.
"""

from __future__ import annotations

# The cause a diagnosis must name for each fault kind (a kind missing here is not scored).
TRUE_CAUSE = {
    "token": "wrong-token",
    "position": "position-changed",
    "prev-hash": "link-changed",
    "real-kv-byte": "kv-bytes-changed",
    "alias": "shared-slot",
    "swap": "shifted-mapping",
    "stale-reuse": "overwritten",
    "slot-zero": "slot-zero",
    "lost-write": "never-written",
    "evicted-block": "overwritten",
}


def site_findings(fault, result) -> list:
    """The findings of ``result`` at the sites of ``fault`` where it must fire (a site with
    expected bits), matched as the detection score matches them: entry, request row (or
    sweep), position and the slot the entry reads."""
    found = []
    for site in fault.sites:
        if not site.bits:
            continue
        found.extend(f for f in result.findings
                     if f.kind == site.entry and f.position == site.position
                     and (site.slot < 0 or f.violation.slot_idx == site.slot)
                     and (site.entry == "sweep" or f.request_row == site.request_row))
    return found


def score_causes(fault, result, cell, *, pair: bool = False) -> list:
    """Count the diagnoses at ``fault``'s sites into ``cell`` (a
    :class:`~kvcanary.campaign.model.Cell`); return the findings that state a certain cause
    other than the fault's (none for a fault of an interacting ``pair``)."""
    truth = TRUE_CAUSE.get(fault.kind)
    if truth is None:
        return []
    found = site_findings(fault, result)
    wrong_certain = []
    for f in found:
        d = f.diagnosis
        cell.diagnosed += 1
        if d.cause == truth:
            cell.named += 1
        else:
            cell.causes[d.cause] += 1
            if d.certain and not pair:
                cell.certain_wrong += 1
                wrong_certain.append(f)
        if truth == d.cause or truth in d.alternatives:
            cell.named_or_alternative += 1
    if found:
        cell.faults_diagnosed += 1
        cell.faults_named += all(f.diagnosis.cause == truth for f in found)
    return wrong_certain
