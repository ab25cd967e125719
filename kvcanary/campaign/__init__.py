"""The coverage campaign behind ``kvcanary campaign``: measure, over many randomized synth
workloads, that the audit detects every injected fault it is designed to see and reports
nothing on clean workloads.

One *fault run* samples a small workload of the layout (per-token: page size 1, 16 or 64;
paged: block tables of 4-, 16- or 32-slot blocks; SWA on or off; 0 to 4 real-KV sources; the
hash mode of the run), plays it with :class:`~kvcanary.synth.Synthesis`, audits the clean
final state, then runs the injections its plan asks for: a copy of the final state gets
faults of the kinds still short of their target at every target class still short (request
heads, last tokens, window heads, chunk boundaries, shared and cached prefix blocks, the
interior), is audited on every backend and under both rule sets (kvcanary's, and
``--compat``: upstream's only), and each fault is scored with :func:`kvcanary.synth.score` at
its sites: every verify entry it changed, with the request row, position and slot the audit
must name. Faults of one injection never interact: synth keeps every target apart from the
others and from their chain neighbours (a content fault breaks its successor's chain link). A
fault with findings at its sites although the canary is not designed to see it would reveal
such crosstalk; the campaign counts these and fails on any.

Rounds of runs are planned from the remaining deficits until every (class, kind, mode) cell
holds at least ``faults_per_kind`` faults; ``real-kv-byte`` in partial mode is split at the 16
bytes partial mode hashes, and each half must reach the target. *Clean runs* are further
randomized workloads (per-token: every one with a sliding window, shared prefix-cache blocks
in a live request's window and a chunk boundary; a sampled workload without them is
replaced), audited without faults; every violation there, in the clean state of a fault run
before its injections, or in a simulation's own in-run verify, is a false positive.

Every run is a function of the campaign seed and its index, independent of ``jobs``; a miss
is reported with the ``kvcanary synth`` / ``kvcanary audit`` commands that reproduce it.

The parts: :mod:`.layouts` (what a table form changes), :mod:`.runner` (the phases and the
worker pool), :mod:`.model` (cells and the report), :mod:`.render` (text, markdown, JSON).
"""

from ..synth.fault_sites import HIGH, LOW
from .layouts import (LAYOUTS, PAGED, PER_TOKEN, RULES, Layout, audit_command, designed,
                      synth_command)
from .model import CampaignError, CampaignReport, Cell
from .render import render
from .runner import (DEFAULT_CLEAN_RUNS, DEFAULT_FAULTS_PER_KIND, FAULT_PHASE, resolve_backends,
                     run_campaign, run_clean_task, run_fault_task)

__all__ = ["DEFAULT_CLEAN_RUNS", "DEFAULT_FAULTS_PER_KIND", "FAULT_PHASE", "HIGH", "LAYOUTS", "LOW", "PAGED",
           "PER_TOKEN", "RULES", "CampaignError", "CampaignReport", "Cell", "Layout",
           "audit_command", "designed", "render", "resolve_backends", "run_campaign",
           "run_clean_task", "run_fault_task", "synth_command"]
