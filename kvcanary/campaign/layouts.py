"""The table forms a campaign plays, one :class:`Layout` each: what differs between a per-token
engine (``req_to_token``, SGLang's) and a paged one (block tables, vLLM-style) is data here,
the designed cells, the sampled workload, the per-run injection plan and its expected yield;
the runner, the report and the renderer are shared.

A new layout is a new :class:`Layout` value in :data:`LAYOUTS` (and its synth options).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

import numpy as np

from ..format.consts import REAL_KV_PARTIAL_READ_BYTES
from ..synth import MODES, TARGET_CLASSES, fault_kinds
from ..synth.fault_kinds import BLOCK_KINDS, PAIR_KINDS, PAIR_SHAPES, PAIRS_NOT_UNION, kind_targets

RULES = ("kvcanary", "compat")
RULE_WORDS = {"kvcanary": "kvcanary rules (default audit)",
              "compat": "--compat (upstream's rules only)"}
BYTES_PER_TOKEN = (16, 32, 64)
LOW, HIGH = f"byte < {REAL_KV_PARTIAL_READ_BYTES}", f"byte >= {REAL_KV_PARTIAL_READ_BYTES}"

# Every per-token fault run ends with one injection of interacting pairs: this many kind
# pairs per shape, this many pairs of each.
PAIR_COMBOS_PER_RUN, PAIRS_PER_COMBO = 2, 4
PAIR_COMBOS = [(a, b) for a in PAIR_KINDS for b in PAIR_KINDS if (a, b) not in PAIRS_NOT_UNION]


def scopes(kind: str, mode: str) -> tuple:
    """The table rows one (kind, mode) splits into: real-kv-byte in partial mode at the bytes
    partial mode hashes."""
    return (LOW, HIGH) if (kind, mode) == ("real-kv-byte", "partial") else ("",)


def fault_scope(kind: str, mode: str, detail: int) -> str:
    if (kind, mode) == ("real-kv-byte", "partial"):
        return LOW if detail < REAL_KV_PARTIAL_READ_BYTES else HIGH
    return ""


def designed(kind: str, mode: str, scope: str, rules: str, target: str = "interior"):
    """``(True, "")`` where the canary is designed to see the fault, else ``(False, why)``."""
    if target == "window-head" and kind == "prev-hash":
        return False, ("the predecessor's SWA slot is already freed, so verify cannot read "
                       "it and the chain check at a window head is vacuous by design")
    if target == "cached" and kind == "token":
        return False, ("sweep entries carry no expected token (the prefix cache keeps no "
                       "token pool); a changed token shows only as its successor's broken "
                       "chain link")
    if target == "cached" and kind == "slot-zero":
        return False, ("verify skips slot 0 as unfilled, and SLOT_ZERO_IN_PREFIX checks live "
                       "requests' tables only, not the prefix cache's blocks")
    if kind == "real-kv-byte" and mode == "none":
        return False, ("mode none does not hash real KV: the record's real-KV field is 0 and "
                       "the bytes are never read")
    if kind == "real-kv-byte" and scope == HIGH:
        return False, (f"partial mode hashes only the first {REAL_KV_PARTIAL_READ_BYTES} bytes "
                       "of each slot's real KV per source")
    if kind == "slot-zero" and rules == "compat":
        return False, ("upstream's verify skips slot 0 as an unfilled slot; only kvcanary's "
                       "SLOT_ZERO_IN_PREFIX audit extension sees it, and --compat turns it off")
    return True, ""


@dataclass(frozen=True)
class Layout:
    """One table form. ``targets`` are its target classes, ``pair_shapes`` its interacting
    pairs; ``fill_order`` is the order an injection fills the classes (the scarce ones first);
    ``per_injection`` and ``class_yield`` size an injection and a round (faults of one
    kind per target class; the next round fixes any shortfall); ``clean_classes``
    are the classes every clean run must verify (a sampled workload without them is
    replaced). The workload fields: ranges are ``integers(low, high)``, tuples a choice."""
    name: str
    title: str
    tables: str                 # the workloads' tables, in words
    paged: bool
    targets: tuple
    fill_order: tuple           # the targets in the order an injection fills them
    pair_shapes: tuple
    per_injection: dict
    class_yield: dict
    block_yield: dict           # paged: class_yield of the kinds that claim a whole block
    clean_classes: tuple
    requests: range
    num_slots: object           # an int, or a tuple to choose from
    max_running: range
    page_sizes: tuple
    prompt_len: tuple

    @property
    def kinds(self) -> tuple:
        return fault_kinds(self.paged)

    @property
    def mix_setting(self) -> tuple:
        """The layout's own setting in the "fault runs by setting" line."""
        if self.paged:
            return ("block_size", "block size", self.page_sizes)
        return ("page_size", "page size", self.page_sizes)

    def cells(self) -> list:
        """Every ``(target class, kind, mode, scope)`` the campaign fills."""
        return [(target, kind, mode, scope) for target in self.targets for kind in self.kinds
                if target in kind_targets(kind) for mode in MODES for scope in scopes(kind, mode)]

    def sample_config(self, rng: np.random.Generator, mode: str, *, clean: bool = False) -> dict:
        """A small randomized workload whose every field is a ``kvcanary synth`` option; a
        per-token clean run always has a sliding window (fault runs cover runs without)."""
        swa = int(rng.integers(24, 65)) if (clean and self.clean_classes) or \
            rng.random() < 0.5 else 0
        slots = self.num_slots
        config = dict(
            requests=int(rng.integers(self.requests.start, self.requests.stop)),
            num_slots=slots if isinstance(slots, int) else int(rng.choice(slots)),
            max_running=int(rng.integers(self.max_running.start, self.max_running.stop)),
            page_size=int(rng.choice(self.page_sizes)),
            swa_window=swa,
            sources=int(rng.integers(0, 5)),
            bytes_per_token=int(rng.choice(BYTES_PER_TOKEN)),
            mode=mode,
            chunk_size=int(rng.choice((7, 16, 32, 64))),
            prompt_len=self.prompt_len,
            output_len=(4, 16),
            verify_every=int(rng.choice((1, 4, 8) if clean else (4, 8))),
            seed=int(rng.integers(0, 2 ** 31 - 1)),
        )
        if self.paged:
            config["block_size"] = config["page_size"]
        return config

    def injections(self, kind: str, mode: str) -> int:
        """Injections of a kind per run. The k-th real-kv-byte fault of an injection lands in
        16-byte window k of the slot (modulo its size); partial mode, whose table splits at
        16 bytes, gets two injections (classes filled in reverse order in the second)."""
        return 2 if (kind, mode) == ("real-kv-byte", "partial") else 1

    def expected_yield(self, target: str, kind: str, mode: str, scope: str,
                       sources_share: float = 0.8) -> float:
        """Expected faults per run of a cell, to size a round."""
        n = (self.block_yield if kind in BLOCK_KINDS and self.paged else self.class_yield)[target]
        if kind == "real-kv-byte":
            n *= sources_share * self.injections(kind, mode)
            if scope == LOW:
                n *= 0.55
            elif scope == HIGH:
                n *= 0.4
        return max(0.5, n * 0.95)

    def plan(self, rng: np.random.Generator, config: dict, need: dict, i: int) -> list:
        """Run ``i`` of a round: the injections, each a list of ``(kind, count, target)``, for
        the (class, kind) pairs that need more than ``i`` runs."""
        plan = []
        for k in self.kinds:
            if k == "real-kv-byte" and config["sources"] == 0:
                continue
            targets = [(k, self.per_injection[t], t) for t in self.fill_order
                       if need.get((t, k), 0) > i]
            if targets:
                plan += [targets if j == 0 else targets[::-1]
                         for j in range(self.injections(k, config["mode"]))]
        if self.pair_shapes:
            combos = rng.choice(len(PAIR_COMBOS), PAIR_COMBOS_PER_RUN, replace=False)
            plan.append([("+".join(PAIR_COMBOS[c]), PAIRS_PER_COMBO, shape)
                         for shape in self.pair_shapes for c in combos.tolist()])
        return plan

    def runs_needed(self, deficit: dict, mode: str) -> dict:
        """``(class, kind) -> runs`` a round plans for the short cells of ``mode``."""
        need = {}
        for (t, k, m, s), n in deficit.items():
            if m == mode:
                need[(t, k)] = max(need.get((t, k), 0),
                                   math.ceil(n / self.expected_yield(t, k, mode, s)))
        return need


def synth_command(config: dict, inject=()) -> str:
    """The ``kvcanary synth`` command that rebuilds a run's dump (and its faults)."""
    c = config
    pages = (["--block-size", c["block_size"]] if c.get("block_size") else
             ["--page-size", c["page_size"]])
    args = ["kvcanary", "synth", "repro.npz", "--requests", c["requests"],
            "--slots", c["num_slots"], "--max-running", c["max_running"],
            *pages, "--swa-window", c["swa_window"],
            "--sources", c["sources"], "--bytes-per-token", c["bytes_per_token"],
            "--mode", c["mode"], "--chunk-size", c["chunk_size"],
            "--prompt-len", "{}..{}".format(*c["prompt_len"]),
            "--output-len", "{}..{}".format(*c["output_len"]),
            "--verify-every", c["verify_every"], "--seed", c["seed"]]
    for kind, count, target in inject:
        args += ["--inject", f"{kind}:{count}@{target}"]
    return " ".join(shlex.quote(str(a)) for a in args)


def audit_command(backend: str, rules: str) -> str:
    return f"kvcanary audit repro.npz --backend {backend}" + (" --compat" if rules == "compat" else "")


PER_TOKEN = Layout(
    name="per-token", title="", tables="page sizes 1/16/64", paged=False,
    targets=TARGET_CLASSES,
    fill_order=("head", "window-head", "last", "chunk-boundary", "shared", "cached", "interior"),
    pair_shapes=PAIR_SHAPES,
    # Every entry of the scarce classes (a few per run), a few of the plentiful ones; classes
    # in the order an injection fills them, the scarce ones first.
    per_injection={"head": 64, "window-head": 64, "last": 64, "chunk-boundary": 64,
                   "shared": 32, "cached": 8, "interior": 8},
    class_yield={"head": 6.0, "window-head": 6.0, "last": 15.0, "chunk-boundary": 26.0,
                 "shared": 16.0, "cached": 8.0, "interior": 8.0}, block_yield={},
    clean_classes=("shared", "window-head", "chunk-boundary"),
    requests=range(48, 97), num_slots=8192, max_running=range(16, 33), page_sizes=(1, 16, 64),
    prompt_len=(8, 48))
# Paged engines: block sizes, and prompts long enough that a request owns several whole
# blocks (block faults claim a block and its neighbours).
PAGED = Layout(
    name="paged", title=", paged layout (block tables)",
    tables="paged: block tables of 4/16/32-slot blocks", paged=True,
    targets=TARGET_CLASSES, fill_order=PER_TOKEN.fill_order, pair_shapes=(),
    # (measured over sampled workloads; the scarce classes first, as per token)
    per_injection={"head": 16, "window-head": 16, "last": 16, "chunk-boundary": 16,
                   "shared": 8, "cached": 4, "interior": 4},
    class_yield={"head": 1.9, "window-head": 1.5, "last": 3.9, "chunk-boundary": 7.6,
                 "shared": 3.8, "cached": 4.0, "interior": 4.0},
    block_yield={"head": 1.1, "window-head": 0.8, "last": 1.5, "chunk-boundary": 0.8,
                 "shared": 0.6, "cached": 1.2, "interior": 0.4},
    clean_classes=(), requests=range(16, 33), num_slots=(2048, 4096), max_running=range(4, 9),
    page_sizes=(4, 16, 32), prompt_len=(16, 96))
LAYOUTS = {layout.name: layout for layout in (PER_TOKEN, PAGED)}
