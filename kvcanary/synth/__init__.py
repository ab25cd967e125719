"""A small but honest serving simulation that produces canary dumps, and fault injection.

The parts of a serving engine, one module each:

* ``allocator``: the slot allocator (pages of ``page_size`` slots, LIFO free list, page 0
  never handed out; SWA slots and the full-to-SWA map under a sliding window). Slots are
  handed out and freed here. A paged engine's blocks are its pages.
* ``tables``: the request-to-slot table, per-token ``req_to_token`` or a block table.
* ``prefix_cache``: the radix-style prefix cache of full blocks, shared by reference count,
  evicted least recently used.
* ``workload``: the requests (shared system prompts, follow-ups of earlier conversations).
* ``scheduler``: admission, chunked prefill, decode, finish.
* ``kv_pool``: the canary records and real KV a step writes, and the canary launches of a
  step (plan, periodic verify, TAIL write); a violation in the honest run raises.
* ``fault_kinds``: the fault kinds, one registered ``FaultKind`` each (description, bits,
  footprint, its change, when the canary can and cannot see it); ``fault_changes``: how each
  kind changes the state; ``fault_sites``: target classes and what a placed fault records.
* ``inject_spec``: the ``--inject`` grammar (``KIND[:COUNT][@CLASS]``) read and checked.
* ``faults``: fault injection into the final state, at target classes (request heads, last
  tokens, window heads, chunk boundaries, shared and cached prefix blocks, the interior).
* ``dump_writer``: the dump keys of a run (live requests, cache blocks as sweep entries,
  ground truth under ``synth_`` keys).
* ``scoring``: ground truth read back from a dump and matched against an audit's findings.
* ``engine``: :class:`Synthesis`, the parts wired together around one random generator.

The same seed and options give the same dump, bit for bit. ``backend="cupy"`` runs every
launch on the CUDA kernels (the library moves the arrays per launch, so keep such runs small).
"""

from .config import MAX_SEED, MODES, SOURCE_DTYPES, Stats, SynthConfig, SynthError
from .engine import Synthesis, synthesize
from .fault_kinds import (EXPECTED_BITS, FAULT_DESCRIPTIONS, FAULT_KINDS, KINDS,
                          PAGED_FAULT_DESCRIPTIONS, PAGED_FAULT_KINDS, FaultKind, fault_kinds,
                          site_bits)
from .fault_sites import TARGET_CLASSES, TARGET_DESCRIPTIONS, Fault, Site
from .inject_spec import inapplicable_kinds, parse_inject
from .scoring import FaultOutcome, fault_note, faults_from_dump, score

__all__ = [
    "EXPECTED_BITS", "FAULT_DESCRIPTIONS", "FAULT_KINDS", "KINDS", "MAX_SEED", "MODES",
    "PAGED_FAULT_DESCRIPTIONS", "PAGED_FAULT_KINDS", "SOURCE_DTYPES", "TARGET_CLASSES",
    "TARGET_DESCRIPTIONS", "Fault", "FaultKind", "FaultOutcome", "Site", "Stats", "SynthConfig",
    "SynthError", "Synthesis", "fault_kinds", "fault_note", "faults_from_dump", "inapplicable_kinds",
    "parse_inject", "score", "site_bits", "synthesize",
]
