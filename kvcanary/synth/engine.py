"""The simulated serving engine: the parts of this package wired together, one random
generator for the whole run (workload and faults), so a seed and options give the same dump."""

from __future__ import annotations

import time

import numpy as np

from ..dump import DUMP_VERSION, VERSION_KEY, Dump, validate
from .allocator import SlotAllocator
from .config import Stats, SynthConfig, SynthError
from .dump_writer import dump_arrays, live_requests, sweep_entries
from .fault_kinds import default_target
from .faults import FaultInjector
from .kv_pool import KvPool
from .prefix_cache import PrefixCache
from .scheduler import Scheduler
from .workload import Workload


class Synthesis:
    """The simulation state; ``run()`` plays the workload, ``inject()`` adds faults,
    ``arrays()`` gives the dump keys."""

    def __init__(self, config: SynthConfig):
        config.validate()
        self.config = c = config
        self.rng = np.random.default_rng(c.seed)
        self.stats = Stats()
        self.allocator = SlotAllocator(c.num_slots, c.page_size, swa=c.swa_window > 0)
        self.pool = KvPool(c, self.allocator.num_canary_slots)
        self.cache = PrefixCache(c.block_tokens, self.allocator, self.stats, c.swa_window)
        self.workload = Workload(c, self.rng)
        self.scheduler = Scheduler(c, self.allocator, self.cache, self.workload, self.pool,
                                   self.stats)
        self.faults: list = []
        self.injector = FaultInjector(self)

    # The state readers (tests, the CLI, fault injection) look at.
    table = property(lambda self: self.scheduler.table.array)   # req_to_token or block_table
    token_pool = property(lambda self: self.scheduler.token_pool)
    running = property(lambda self: self.scheduler.running)
    admitted = property(lambda self: self.scheduler.admitted)
    canary = property(lambda self: self.pool.canary)
    sources = property(lambda self: self.pool.sources)
    lut = property(lambda self: self.allocator.lut)
    num_canary_slots = property(lambda self: self.allocator.num_canary_slots)

    def run(self, progress=None) -> "Synthesis":
        """Play the workload until every request was admitted and has finished its prefill;
        the requests still running are the dump's live requests."""
        started = time.perf_counter()
        scheduler = self.scheduler
        while True:
            while scheduler.admit():
                pass
            if not scheduler.running:
                raise SynthError("internal: nothing is running and nothing can be admitted")
            self._step()
            if progress:   # the run ends when every request is admitted and prefilled
                progress(scheduler.admitted - sum(r.seq_len < r.prompt_len
                                                  for r in scheduler.running),
                         self.config.requests)
            if scheduler.all_admitted_and_prefilled:
                break
        self.stats.elapsed_s = time.perf_counter() - started
        return self

    def _step(self) -> None:
        self.scheduler.step()

    def inject(self, kind: str, count: int = 1, target: str | None = None) -> list:
        """Inject ``count`` faults of ``kind`` at ``target`` entries of the final state (by
        default the kind's :func:`~kvcanary.synth.faults.default_target`; a SynthError when
        fewer fit); returns them."""
        return self.injector.inject(kind, count, target or default_target(kind))

    def inject_up_to(self, kind: str, count: int, target: str | None = None) -> list:
        """Inject at most ``count`` faults, as many as there are free ``target`` entries."""
        return self.injector.inject_up_to(kind, count, target or default_target(kind))

    def live(self) -> tuple:
        return live_requests(self.running)

    def sweep_entries(self):
        return sweep_entries(self.cache, self.lut)

    def arrays(self) -> dict:
        return dump_arrays(self)

    def dump(self) -> Dump:
        """The current state as a validated in-memory :class:`~kvcanary.dump.Dump`, what
        ``load`` gives after ``save(path, **synthesis.arrays())``."""
        values = {VERSION_KEY: np.array(DUMP_VERSION, dtype=np.int64)}
        values.update((key, np.asarray(value)) for key, value in self.arrays().items()
                      if value is not None)
        return validate("<synth>", "memory", values)


def synthesize(config: SynthConfig, inject=(), progress=None) -> Synthesis:
    """Run the simulation, then inject ``[(kind, count[, target class]), ...]``."""
    synthesis = Synthesis(config).run(progress=progress)
    for kind, count, *target in inject:
        synthesis.inject(kind, count, *target)
    return synthesis
