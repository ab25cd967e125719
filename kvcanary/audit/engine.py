"""The audit's one loop: resolve the backend, check the dump's bounds, run every live and
sweep launch through verify, attribution and the tally, then diagnose the kept findings
(:mod:`kvcanary.audit` describes the steps)."""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter

import numpy as np

from ..backends.resolve import resolve_backend
from ..format.consts import MAX_REAL_KV_SOURCES
from ..dump import load
from ..model.types import check_source_bound, check_source_count
from . import distinct
from .diagnose import diagnose_findings
from .launches import (Launcher, live_launches, live_requests, slot_zero_rows, sweep_launches,
                       verify_rows)
from .matching import attribute_rows
from .result import (CHUNK_ENTRIES, DEFAULT_MAX_FINDINGS, EAGER_FINDINGS, AuditError,
                     AuditResult, CauseCounts, CheckedLaunch)
from .tally import Tally


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
    live = live_requests(d)
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

    grouped = None
    if live_entries > min(distinct.GROUPING_THRESHOLD, distinct.claim_limit(d)):
        grouped = distinct.group_live(d, live)
        if grouped is not None:
            distinct.check_claim(d, grouped)
        if grouped is not None and distinct.MIN_SHARING * grouped.entries > live_entries:
            grouped = None    # little is shared: plan every request as it is
    launcher = Launcher(d, chosen, max_real_kv_sources)
    check_token = d.expected_tokens is not None
    result = AuditResult(
        path=d.path, backend=chosen, launch_tag=d.launch_tag.name, num_slots=d.num_slots,
        live_requests=int(d.live_batch().size),
        live_entries=live_entries, sweep_entries=d.num_sweep_entries,
        real_kv_sources=len(d.real_kv), real_kv_hash_mode=d.real_kv_hash_mode.name.lower(),
        swa_window_size=d.swa_window_size, check_expected_token=check_token, compat=compat,
        ring_capacity=ring_capacity, max_findings=int(max_findings))
    keep = min(ring_capacity, max_findings or ring_capacity)
    tally = Tally(d, keep)
    chunk = max(1, int(chunk_entries))
    done, found = 0, None
    if grouped is not None:
        work = grouped.entries + d.num_sweep_entries
        found = distinct.verify_groups(d, launcher, grouped, chunk, compat, observe=observe,
                              progress=progress and (lambda n, _: progress(n, work)), total=work)
        tally.add_distinct(grouped, found)
        done, total_entries = grouped.entries, work
        result.distinct_live_entries = grouped.entries
    launches = sweep_launches(d, launcher, chunk) if grouped is not None else itertools.chain(
        live_launches(d, launcher, live, chunk), sweep_launches(d, launcher, chunk))
    for launch in launches:
        rows = verify_rows(launcher, launch)
        entry_of = attribute_rows(rows, launch, launcher)
        if launch.live and not compat:
            zero_rows, zero_entries = slot_zero_rows(launch.entries, launch.tag, check_token)
            rows = np.concatenate([rows, zero_rows])
            entry_of = np.concatenate([entry_of, zero_entries])
        tally.add(rows, entry_of, launch)
        if observe:
            observe(CheckedLaunch(launch.entries.slots, launch.entries.positions,
                                  launch.batch_index, rows, entry_of))
        done += launch.size
        if progress:
            progress(done, total_entries)
    if progress and done < total_entries:   # sweep entries in a sparse file's holes
        progress(total_entries, total_entries)
    findings, result.zero_records = diagnose_findings(tally, d, launcher, live, chunk, grouped, found)
    tally.fill(result)
    # A short list is built now; a long one (--max-findings 0 on a flooded dump) stays
    # arrays, its findings built and diagnosed a batch at a time whenever it is read.
    if len(findings) <= EAGER_FINDINGS:
        result.findings = list(findings)
        result.counts_by_cause = dict(sorted(Counter(
            f.diagnosis.cause for f in result.findings).items()))
    else:
        result.findings, result.counts_by_cause = findings, CauseCounts(findings)
    result.elapsed_s = time.perf_counter() - started
    return result
