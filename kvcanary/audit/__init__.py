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

Requests that read the same entries (a shared prefix, a copied table row, batch entries on
one row) are verified once per distinct entry when they claim at least twice what is
distinct (``distinct``): each row then counts for every request reading its entry, and a claim
of more distinct entries than any engine state could hold is refused.

The steps, one module each: ``launches`` builds the entries (``live_launches``,
``sweep_launches``) and runs one launch (``verify_rows``), ``distinct`` groups shared
entries, ``matching`` names the entry of each row (``attribute_rows``), ``tally``
summarises (``Tally``), ``diagnose`` explains (``diagnose_findings``); ``result`` holds what the audit returns. :func:`audit`
(``engine``) runs the one loop over both kinds of launches.
"""

from ..findings.diagnosis import Diagnosis, likely_cause
from .engine import audit
from .result import (CHUNK_ENTRIES, DEFAULT_MAX_FINDINGS, AuditError, AuditResult,
                     CheckedLaunch, Finding, FindingList, RequestSummary)

__all__ = ["CHUNK_ENTRIES", "DEFAULT_MAX_FINDINGS", "AuditError", "AuditResult", "CheckedLaunch",
           "Diagnosis", "Finding", "FindingList", "RequestSummary", "audit", "likely_cause"]
