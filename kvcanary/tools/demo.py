"""The demo behind ``kvcanary demo``: synthesise a workload, audit it clean, inject every
fault kind, audit again and score each injected fault against the audit's findings."""

from __future__ import annotations

import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field

from ..audit import audit
from ..dump import load, save
from ..format.errors import CanaryError
from ..synth import FAULT_KINDS, KINDS, Synthesis, SynthConfig, faults_from_dump, score
from ..format.violations import reason_labels

DEMO_CONFIG = dict(requests=48, num_slots=2048, max_running=16, sources=2, bytes_per_token=32)
# One fault per row a kind's partial-mode table has: two real-KV byte faults, the first in the
# leading 16 bytes, the second after them. The default mode, all, sees both; partial mode
# shows one fault it sees and one it cannot.
DEMO_FAULTS = tuple((name, len(KINDS[name].scopes("partial"))) for name in FAULT_KINDS)


@dataclass
class KindRow:
    kind: str
    injected: int = 0
    detected: int = 0
    invisible: int = 0
    missed: int = 0
    fired: set = field(default_factory=set)
    notes: list = field(default_factory=list)


@dataclass
class DemoReport:
    synthesis: Synthesis
    clean: object
    faulty: object
    outcomes: list
    rows: list
    kept: tuple = ()   # (clean, faulty) dump paths when a workdir was given

    @property
    def passed(self) -> bool:
        return self.clean.clean and all(row.missed == 0 for row in self.rows)

    @property
    def faults(self) -> int:
        return sum(row.injected for row in self.rows)

    def example(self):
        """A finding to show: the first one at an injected fault's entry that also breaks
        the next token's chain link (a changed token), else the first finding."""
        findings = self.faulty.findings
        token = [o for o in self.outcomes if o.kind == "token" and o.detected]
        for outcome in token:
            for finding in findings:
                if (finding.request_row, finding.position) == (outcome.request_row,
                                                               outcome.position):
                    return finding
        return findings[0] if findings else None


# The dumps ``run_demo`` writes into its ``workdir``.
KEPT_DUMPS = ("clean.npz", "faulty.npz")


def run_demo(*, mode: str = "all", seed: int = 0, backend: str = "auto",
             workdir: str | None = None, compat: bool = False, progress=None,
             **overrides) -> DemoReport:
    config = SynthConfig(**{**DEMO_CONFIG, **overrides, "mode": mode, "seed": seed})
    with tempfile.TemporaryDirectory(prefix="kvcanary-demo-") as scratch:
        where = workdir or scratch
        os.makedirs(where, exist_ok=True)
        synthesis = Synthesis(config).run(progress=progress)
        clean_path, faulty_path = (os.path.join(where, name) for name in KEPT_DUMPS)
        save(clean_path, **synthesis.arrays())
        clean = audit(clean_path, backend=backend, compat=compat, max_findings=0)
        for kind, count in DEMO_FAULTS:
            synthesis.inject(kind, count)
        save(faulty_path, **synthesis.arrays())
        faulty_dump = load(faulty_path)
        faulty = audit(faulty_dump, backend=backend, compat=compat, max_findings=0)
        outcomes = score(faults_from_dump(faulty_dump), faulty)
    rows = {}
    for outcome in outcomes:
        row = rows.setdefault(outcome.kind, KindRow(outcome.kind))
        row.injected += 1
        if outcome.detected:
            row.detected += 1
            row.fired.update(reason_labels(outcome.fired_bits))
        elif not outcome.visible:
            row.invisible += 1
            row.notes.append(outcome.note)
        else:
            row.missed += 1
            row.fired.update(reason_labels(outcome.fired_bits))
            row.notes.append("MISSED: " + (outcome.note or "no finding at the target entry"))
    return DemoReport(synthesis=synthesis, clean=clean, faulty=faulty, outcomes=outcomes,
                      rows=[rows[k] for k in FAULT_KINDS if k in rows],
                      kept=(clean_path, faulty_path) if workdir else ())


def group_notes(notes) -> list:
    counts = defaultdict(int)
    for note in notes:
        counts[note] += 1
    return [f"{n} {note}" if n > 1 else note for note, n in counts.items()]


# ------------------------------------------------------------------ a real engine

ENGINE_DEMO = dict(requests=16, prefix=24, new_tokens=8, page_size=8)


@dataclass
class EngineDemoReport:
    clean: dict                 # the clean run's summary
    faulty: dict                # the faulted run's summary
    findings: list              # the faulted run's findings
    fault: str                  # what was injected, in words
    victim: tuple               # (request id, first position of the remapped block)

    @property
    def passed(self) -> bool:
        return self.clean["findings"] == 0 and bool(self.hits())

    def hits(self) -> list:
        rid, first = self.victim
        page = ENGINE_DEMO["page_size"]
        return [f for f in self.findings
                if f.request_id == rid and first <= f.position < first + page]


def run_engine_demo(engine: str = "transformers", seed: int = 0) -> EngineDemoReport:
    """Generate with a tiny randomly initialised Llama through transformers' continuous
    batching under a guard, clean and then with one block-table entry of a decoding request
    remapped onto another request's block (a fault in the engine's own state). Needs torch
    and transformers (``ImportError`` otherwise)."""
    if engine != "transformers":
        raise CanaryError(f"demo engine must be 'transformers', got {engine!r}")
    import random

    import torch
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.input_outputs import (
        ContinuousBatchingIOs,
    )

    from ..integrations import transformers as kvt
    from .engine_logs import without_setup_advisories

    transformers.utils.logging.set_verbosity_error()
    c = ENGINE_DEMO
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    r = random.Random(seed)
    prefix = [r.randrange(1, 128) for _ in range(c["prefix"])]
    prompts = [prefix + [r.randrange(1, 128) for _ in range(r.randrange(10, 20))]
               for _ in range(c["requests"])]
    generation = GenerationConfig(max_new_tokens=c["new_tokens"], do_sample=False,
                                  eos_token_id=None, pad_token_id=0)

    def generate(guard):
        with without_setup_advisories(), guard:
            model.generate_batch(inputs=prompts, generation_config=generation,
                                 continuous_batching_config=ContinuousBatchingConfig(
                                     page_size=c["page_size"], num_blocks=64,
                                     max_batch_tokens=64, max_requests_per_batch=8))
        return guard

    clean = generate(kvt.guard(model, on_violation=lambda finding: None))
    block = c["prefix"] // c["page_size"]          # the first block past the shared prefix
    target = {}
    original = ContinuousBatchingIOs.prepare_batch_tensors

    def prepare(io, requests_in_batch, *args, **kwargs):
        decoding = [f.state for f in requests_in_batch if f.query_length == 1 and
                    f.state.position_offset >= (block + 1) * c["page_size"]]
        if not target and len(decoding) >= 2:
            table = next(iter(io.cache.cache_allocators.values())).block_table
            victim, other = decoding[:2]
            table[victim.request_id][block] = table[other.request_id][block]
            target.update(victim=victim.request_id, other=other.request_id)
        return original(io, requests_in_batch, *args, **kwargs)

    ContinuousBatchingIOs.prepare_batch_tensors = prepare
    try:
        faulty = generate(kvt.guard(model, on_violation=lambda finding: None))
    finally:
        ContinuousBatchingIOs.prepare_batch_tensors = original
    fault = (f"block {block} of {target.get('victim')}'s block table remapped onto "
             f"{target.get('other')}'s block")
    return EngineDemoReport(clean=clean.summary(), faulty=faulty.summary(),
                            findings=faulty.findings(), fault=fault,
                            victim=(target.get("victim"), block * c["page_size"]))
