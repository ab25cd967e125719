"""What a guarded server keeps and reports: its guards (one per model the server loads), the
findings with the HTTP request each belongs to, the canary log, the Prometheus metrics, and
what a finding does (``log``, ``abort-request``, ``exit``)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ...format.errors import GUARD_PREFIX
from ..transformers import Guard, GuardError
from ..transformers.manager import abort_all, abort_request

logger = logging.getLogger("kvcanary")

ON_VIOLATION = ("log", "abort-request", "exit")
# Findings the server keeps for /kvcanary/findings (the newest); counts cover all of them.
FINDINGS_KEPT = 10_000
# Step times of the guard's histogram, in seconds.
GUARD_SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
                         0.25, 0.5, 1.0)
_FORK = "__child#"


def http_request_of(request_id: str) -> str:
    """The HTTP request (its ``x-request-id``) an engine request belongs to: a fork's child
    ``<id>__child#k`` belongs to ``<id>``."""
    return str(request_id).split(_FORK, 1)[0]


class ServeState:
    """The guarded server's shared state (thread-safe: the guards report on the engine's
    thread, the endpoints read on the server's)."""

    def __init__(self, *, sources, hash_mode, check_tokens, plan_from, on_violation,
                 canary_log=None, drills=None):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        if sources not in ("k0", "kv-all", ()):
            raise GuardError(f"--sources must be k0, kv-all or none, got {sources!r}")
        if on_violation not in ON_VIOLATION:
            raise GuardError(f"--on-violation must be one of "
                             f"{', '.join(ON_VIOLATION)}, got {on_violation!r}")
        self.guard_options = dict(sources=sources, hash_mode=hash_mode,
                                  check_tokens=check_tokens, plan_from=plan_from)
        self.on_violation = on_violation
        self.drills = drills
        self.guards: list = []
        self.lock = threading.Lock()
        self.findings = deque(maxlen=FINDINGS_KEPT)
        self.findings_total = 0
        self.exit_requested = threading.Event()
        self.exit_code = 0
        self._log = open(canary_log, "a", encoding="utf-8") if canary_log else None
        self.registry = CollectorRegistry()
        self.findings_counter = Counter("kvcanary_findings", "Distinct KV-cache problems found",
                                        ["reason"], registry=self.registry)
        self.guard_seconds = Histogram("kvcanary_guard_seconds",
                                       "The guard's time per engine step (seconds)",
                                       buckets=GUARD_SECONDS_BUCKETS, registry=self.registry)
        self.registry.register(_StatsCollector(self))

    # -- guards

    def guard_for(self, model) -> "ServeGuard":
        """A :class:`ServeGuard` of ``model``, entered (its hooks are active)."""
        from ..transformers import guard

        plain = guard(model, on_violation=lambda finding: None, **self.guard_options)
        g = ServeGuard(self, plain)
        g.__enter__()
        with self.lock:
            self.guards.append(g)
        return g

    def release(self, g) -> None:
        g.__exit__(None, None, None)

    def totals(self) -> dict:
        """The guards' summed counters."""
        keys = ("steps", "entries_verified", "tokens_written", "requests_guarded")
        out = dict.fromkeys(keys, 0)
        with self.lock:
            guards = list(self.guards)
        for g in guards:
            for key in keys:
                out[key] += int(g.stats.get(key, 0))
        return out

    # -- findings

    def record(self, g, finding) -> None:
        """One new finding of guard ``g``: kept, counted, logged, written to the canary
        log, then acted on (``--on-violation``)."""
        entry = finding.to_dict()
        entry["http_request_id"] = http_request_of(finding.request_id)
        entry["time"] = time.time()
        reason = "+".join(finding.reasons)
        with self.lock:
            self.findings_total += 1
            entry["index"] = self.findings_total
            self.findings.append(entry)
            self.findings_counter.labels(reason=reason).inc()
            if self._log is not None:
                self._log.write(self._log_block(finding, entry) + "\n")
                self._log.flush()
        logger.warning("%s request=%s position=%d http_request=%s: likely cause: %s",
                       finding.log_line, finding.request_id, finding.position,
                       entry["http_request_id"], finding.explanation)
        message = (f"{GUARD_PREFIX}KV-cache violation in this request ({reason} at position "
                   f"{finding.position}); the request was ended: {finding.explanation}")
        if self.on_violation == "abort-request":
            abort_request(g, finding.request_id, message)
        elif self.on_violation == "exit":
            abort_all(g, f"{GUARD_PREFIX}KV-cache violation, the server is stopping: "
                         f"{finding.explanation}")
            self.exit_code = 1
            self.exit_requested.set()

    @staticmethod
    def _log_block(finding, entry) -> str:
        at = (f"  at: request={finding.request_id} position={finding.position} "
              f"http_request={entry['http_request_id']} step={finding.first_step}")
        if finding.violation is None:         # a guard check alone: no ring row
            return f"{finding.log_line}\n{at}"
        block = finding.violation.format_block(total_violations=entry["index"],
                                               ring_overflow=False,
                                               step_when_pumped=finding.first_step)
        return f"{block}\n{at}"

    def findings_json(self) -> dict:
        with self.lock:
            return {"total": self.findings_total, "kept": len(self.findings),
                    "findings": list(self.findings)}

    def summary(self) -> dict:
        with self.lock:
            guards = list(self.guards)
            total = self.findings_total
        per_model = [dict(g.summary(), model=type(g.model).__name__, **_kept(g))
                     for g in guards]
        return {"on_violation": self.on_violation, "findings": total,
                **{k: v for k, v in self.totals().items()},
                "guards": per_model, "options": self.guard_options,
                "drills": [] if self.drills is None else
                [d.to_dict() for d in self.drills.drills]}

    def close(self) -> None:
        with self.lock:
            if self._log is not None:
                self._log.close()
                self._log = None


def _kept(g) -> dict:
    """What the guard's session holds per request now (the live requests only)."""
    groups = [] if g.session is None else g.session.groups
    return {"requests_tracked": sum(len(s.requests) for s in groups),
            "request_names": sum(len(s.request_names) for s in groups)}


class ServeGuard(Guard):
    """A guard whose findings go to the server's :class:`ServeState`, and whose step times
    feed its histogram."""

    def __init__(self, state: ServeState, plain: Guard):
        super().__init__(plain.model, plain.sources, plain.hash_mode, plain.check_tokens,
                         plain.plan_from, plain.on_violation, plain.ring_capacity)
        self.stats.setdefault("requests_guarded", 0)
        self._state = state

    def report(self, finding) -> None:
        self._state.record(self, finding)

    def time_step(self, guard_s: float, engine_s: float) -> None:
        super().time_step(guard_s, engine_s)
        self._state.guard_seconds.observe(guard_s)


class _StatsCollector:
    """The guards' running counters as Prometheus counters, read at each scrape."""

    def __init__(self, state: ServeState):
        self.state = state

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        totals = self.state.totals()
        for name, key, text in (
                ("kvcanary_steps", "steps", "Engine steps guarded"),
                ("kvcanary_entries_verified", "entries_verified", "Prefix entries verified"),
                ("kvcanary_tokens_written", "tokens_written", "Tokens whose records were written"),
                ("kvcanary_requests_guarded", "requests_guarded",
                 "Engine requests guarded to their end")):
            yield CounterMetricFamily(name, text, value=totals[key])
