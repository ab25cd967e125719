"""Guard Hugging Face transformers' continuous batching (``model.generate_batch``) with kvcanary.

::

    from kvcanary.integrations import transformers as kvt

    guard = kvt.guard(model, sources="k0", hash_mode="all", check_tokens=True,
                      plan_from="read_indices", on_violation="log")
    with guard:
        outputs = model.generate_batch(inputs=prompts, generation_config=config)
    guard.findings()        # one Finding per distinct problem
    guard.summary()         # steps, entries verified, tokens written, findings, ...
    guard.dump("last.npz")  # the last step as a dump `kvcanary audit` reads

The parts, each its own module:

* :mod:`.hooks` -- where kvcanary hooks into the engine (only while the ``with`` block runs,
  only for the given model) and how transformers is restored on exit;
* :mod:`.groups` -- one session per cache group (full-attention and sliding-window layers
  each have their own allocator): a sliding group verifies the window its attention reads;
  models kvcanary cannot guard are refused at :func:`guard`;
* :mod:`.session` -- kvcanary's state beside one cache group, step by step: before the
  forward the plan (from the step's read indices or the allocator's block table) and the
  verify of every prefix slot the step reads; after it the write of the step's new tokens at
  the slots the engine's write indices really name; records copied on forks and carried
  through offloading; the dump;
* :mod:`.guarding` -- :func:`guard` and :class:`Guard`, which also wraps the model's
  ``generate_batch`` (an instance attribute, removed on exit), so that
  ``on_violation="raise"`` reaches the caller as :class:`GuardError`;
* this module -- re-exports the public names.

Canary slot of (block, offset) is ``block * page_size + offset``; the engine's physical row
index ``block * block_physical_stride + offset`` maps to it. Block 0 (the engine's read trash)
is kvcanary's null block. Real-KV sources are views of the engine's cache tensor (zero-copy):
layer ``i``'s K (or V) rows of every block. torch and transformers are imported in this package only.
"""

from __future__ import annotations

from ...format.errors import GuardError
from .guarding import (HASH_MODES, MAX_RING_CAPACITY, ON_VIOLATION, PLAN_FROM,  # noqa: F401
                       SOURCE_PRESETS, Guard, guard)
from .hooks import SUPPORTED_RANGE, SUPPORTED_VERSIONS, supported_version
from .session import Session  # noqa: F401  (tests patch it)

__all__ = ["GuardError", "Guard", "SUPPORTED_RANGE", "SUPPORTED_VERSIONS", "guard",
           "supported_version"]
