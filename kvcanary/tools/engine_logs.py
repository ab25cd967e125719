"""What the engine demo lets through of transformers' own log.

transformers' continuous batching logs advisories about how the demo itself is set up (no
psutil to size memory with, no end-of-sequence token: the demo sets none on purpose). They
say nothing about the run and read like failures (``ERROR ... without psutil``), so the demo
drops exactly those; every other record, errors first of all, still shows as the engine
writes it.
"""

from __future__ import annotations

import contextlib
import logging

# The loggers transformers writes through: its continuous batching logger has a handler of
# its own and does not propagate; the rest go through the "transformers" logger's handlers.
ENGINE_LOGGERS = ("ContinuousBatchingLogger", "transformers")
# Openings of the advisories about the demo's own set-up (transformers' message texts).
SETUP_ADVISORIES = (
    "Cannot get memory breakdown on CPU without psutil",
    "psutil is not available",
    "`eos_token_id` not set in GenerationConfig",
)


class SetupAdvisoryFilter(logging.Filter):
    """Drops a record whose message opens with one of :data:`SETUP_ADVISORIES`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(SETUP_ADVISORIES)


@contextlib.contextmanager
def without_setup_advisories():
    """Within the block, the engine's loggers (and their handlers, which records of child
    loggers reach) drop the set-up advisories; on leaving, the filter goes again."""
    advisory = SetupAdvisoryFilter()
    targets = []
    for name in ENGINE_LOGGERS:
        logger = logging.getLogger(name)
        targets += [logger, *logger.handlers]
    for target in targets:
        target.addFilter(advisory)
    try:
        yield
    finally:
        for target in targets:
            target.removeFilter(advisory)
