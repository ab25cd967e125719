"""Guard vLLM's scheduler and KV cache manager with kvcanary (scheduler mode).

::

    from kvcanary.integrations import vllm as kvv

    guard = kvv.guard(engine_core.scheduler, check_tokens=True, on_violation="log")
    with guard:
        ...                 # the engine's loop: schedule -> model runner -> update
    guard.findings()        # one Finding per distinct problem, vLLM's request ids
    guard.summary()         # steps, entries verified, tokens written, findings, cost
    guard.dump("last.npz")  # the last step as a dump `kvcanary audit` reads

The guard wraps the scheduler's ``schedule`` (an instance attribute, removed on exit):
each ``SchedulerOutput`` is what the model runner receives, so the block tables kvcanary
checks are rebuilt from it alone (:mod:`.session`). Records are planned, written and
verified per KV cache group over one canary buffer for vLLM's block pool; hybrid models
(full and sliding-window groups) get a table per group. With the scheduler alone this is
bookkeeping: it sees no KV bytes, so it finds blocks mapped, freed, cached or resumed
wrongly, not a changed KV byte. Given the model runner too (``model_runner=``, the
model-runner mode of :mod:`.runner`), the records are written at the forward's real
``slot_mapping`` and fingerprint the real KV bytes, so a misdirected write and a changed KV
byte are found as well. :mod:`.guarding` holds :func:`guard` and
:class:`Guard`, :mod:`.causes` what only vLLM's bookkeeping tells about a finding, :mod:`.plugin`
installs the guard in a deployment; this module re-exports the public names. vLLM is imported
only when a guard starts.
"""

from __future__ import annotations

from ...format.errors import GuardError
from .guarding import ON_VIOLATION  # noqa: F401  (the plugin's choices)
from .guarding import SUPPORTED_RANGE, SUPPORTED_VERSIONS, Guard, guard, supported_version

__all__ = ["GuardError", "Guard", "SUPPORTED_RANGE", "SUPPORTED_VERSIONS", "guard",
           "supported_version"]
