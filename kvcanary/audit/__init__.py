"""Audit a dump: verify every live request's prefix (and the sweep entries) the way the
runtime would, then explain each violation.

Data flows plan -> verify -> violations -> findings:

1. For every live request (``req_pool_indices != 0``) the verify plan covers positions
   ``[window_start, seq_len)``, built by ``kvcanary.plan`` with ``prefix_lens = seq_lens``
   and ``extend_seq_lens = 0``, in groups of requests so memory stays bounded; a request
   longer than one launch (``chunk_entries``) is planned in pieces by the reference's rule.
2. ``kvcanary.verify`` checks them on the chosen backend (numpy reference or CUDA kernels),
   with the token check on when the dump carries ``expected_tokens``.
3. kvcanary's slot-zero extension (off with ``compat=True``) adds a
   ``SLOT_ZERO_IN_PREFIX`` row for every live prefix entry mapped to padding slot 0.
4. Each row is attributed to the plan entry that produced it (request row and position, or
   sweep entry) and gets the failed checks in words.
5. Each kept finding gets its :func:`~kvcanary.findings.diagnosis.diagnose`: the cause, from the
   other live entries on its slot and the records its own record continues.

Every row counts: totals, counts by reason, by tag and by request, and the first and last
affected positions of each request cover every row and are computed over whole arrays. Only
the first ``max_findings`` rows (default 1024, 0 for all) become :class:`Finding` objects, so a
dump whose every record is corrupt audits about as fast as a clean one; rows beyond
``ring_capacity`` count as dropped by upstream's fill-once ring. Checking zero entries is an
error.

The steps, one module each: ``launches`` builds the entries (``_live_launches``,
``_sweep_launches``) and runs one launch (``_verify``), ``matching`` names the entry of each
row (``_attribute``), ``tally`` summarises (``_Tally``), ``diagnose`` explains (``_diagnose``);
``result`` holds what the audit returns. :func:`audit` here runs the one loop over both kinds
of launches.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter

import numpy as np

from ..backends.resolve import resolve_backend
from ..format.consts import MAX_REAL_KV_SOURCES
from ..findings.diagnosis import Diagnosis, likely_cause
from ..dump import load
from ..model.types import check_source_bound, check_source_count
from .diagnose import _diagnose
from .launches import (_Launcher, _live_launches, _live_requests, _slot_zero_rows, _sweep_launches,
                       _verify)
from .matching import _attribute
from .result import (CHUNK_ENTRIES, DEFAULT_MAX_FINDINGS, AuditError, AuditResult,
                     CheckedLaunch, Finding, RequestSummary)
from .tally import _Tally

__all__ = ["CHUNK_ENTRIES", "DEFAULT_MAX_FINDINGS", "AuditError", "AuditResult", "CheckedLaunch",
           "Diagnosis", "Finding", "RequestSummary", "audit", "likely_cause"]


def audit(dump, *, backend: str = "auto", max_real_kv_sources: int = MAX_REAL_KV_SOURCES,
          ring_capacity: int | None = None, max_findings: int = DEFAULT_MAX_FINDINGS,
          compat: bool = False, chunk_entries: int = CHUNK_ENTRIES, progress=None,
          observe=None) -> AuditResult:
    """Audit a :class:`~kvcanary.dump.Dump` (or a path to one); see the module docstring.

    ``max_findings`` bounds the rows kept as findings (0 keeps every row); the totals and
    counts always cover every row. ``progress(done_entries, total_entries)`` is called after
    every launch when given; ``observe(CheckedLaunch)`` too, with every row of the launch.

    Example (every row, however many findings are kept)::

        launches = []
        result = audit("dump.npz", backend="numpy", observe=launches.append)
        assert sum(l.rows.shape[0] for l in launches) == result.total_violations"""
    started = time.perf_counter()
    if isinstance(dump, (str, os.PathLike)):
        dump = load(dump)
    d = dump
    try:
        chosen = resolve_backend(backend)
    except ValueError as exc:
        raise AuditError(getattr(exc, "detail", str(exc))) from None
    live = _live_requests(d)
    live_entries = live.entries
    total_entries = live_entries + d.num_sweep_entries
    if total_entries == 0:
        raise AuditError(f"{d.path}: nothing to check: no live request has a written prefix "
                         "(req_pool_indices / seq_lens) and there are no sweep entries; "
                         "an audit of zero entries proves nothing")
    ring_capacity = total_entries if ring_capacity is None else int(ring_capacity)
    if ring_capacity < 1:
        raise AuditError(f"ring capacity must be at least 1, got {ring_capacity}")
    if max_findings < 0:
        raise AuditError(f"max_findings must be 0 (keep every finding) or more, got {max_findings}")
    bound = check_source_bound(max_real_kv_sources)
    try:
        check_source_count(len(d.real_kv), bound,
                           raise_with="kvcanary audit --max-real-kv-sources N")
    except ValueError as exc:   # one line: the CLI shows a single line per error
        text = " ".join(getattr(exc, "detail", str(exc)).splitlines())
        raise AuditError(f"{d.path}: key real_kv_params: {text}") from None

    launcher = _Launcher(d, chosen, max_real_kv_sources)
    check_token = d.expected_tokens is not None
    result = AuditResult(
        path=d.path, backend=chosen, launch_tag=d.launch_tag.name, num_slots=d.num_slots,
        live_requests=int(np.count_nonzero(np.asarray(d.req_pool_indices))),
        live_entries=live_entries, sweep_entries=d.num_sweep_entries,
        real_kv_sources=len(d.real_kv), real_kv_hash_mode=d.real_kv_hash_mode.name.lower(),
        swa_window_size=d.swa_window_size, check_expected_token=check_token, compat=compat,
        ring_capacity=ring_capacity, max_findings=int(max_findings))
    keep = min(ring_capacity, max_findings or ring_capacity)
    tally = _Tally(d, keep)
    chunk = max(1, int(chunk_entries))
    done = 0
    launches = itertools.chain(_live_launches(d, launcher, live, chunk),
                               _sweep_launches(d, launcher, chunk))
    for launch in launches:
        rows = _verify(launcher, launch)
        entry_of = _attribute(rows, launch, launcher)
        if launch.live and not compat:
            zero_rows, zero_entries = _slot_zero_rows(launch.entries, launch.tag, check_token)
            rows = np.concatenate([rows, zero_rows])
            entry_of = np.concatenate([entry_of, zero_entries])
        tally.add(rows, entry_of, launch)
        if observe:
            observe(CheckedLaunch(launch.entries.slots, launch.entries.positions,
                                  launch.batch_index, rows, entry_of))
        done += launch.size
        if progress:
            progress(done, total_entries)
    tally.findings, result.zero_records = _diagnose(tally, d, launcher, live, chunk)
    tally.fill(result)
    result.counts_by_cause = dict(sorted(Counter(
        f.diagnosis.cause for f in tally.findings).items()))
    result.elapsed_s = time.perf_counter() - started
    return result
