"""kvcanary's error type. Every refusal says what is wrong in one sentence and names the
argument, key or file at fault; the message prefix is written here once.

>>> err = CanaryError("bs=9 exceeds write_req_capacity=8", key="bs")
>>> str(err), err.detail, err.key
('kv-canary: bs=9 exceeds write_req_capacity=8', 'bs=9 exceeds write_req_capacity=8', 'bs')
"""

from __future__ import annotations

ERROR_PREFIX = "kv-canary: "


class Prefixed:
    """What every kvcanary error carries: ``detail`` (the sentence without the prefix, what
    the CLI prints) and ``key`` (the argument, dump key or file it names, or None);
    ``str()`` is ``prefix + detail``. Mixed into a built-in exception class."""

    prefix = ERROR_PREFIX

    def __init__(self, detail: str, *, key: str | None = None):
        super().__init__(f"{self.prefix}{detail}")
        self.detail = detail
        self.key = key

    def __reduce__(self):
        # Rebuilt from the detail (not from args, which hold the prefixed text), so an error
        # sent back from a worker process reads the same.
        return type(self), (self.detail,), self.__dict__


class CanaryError(Prefixed, ValueError):
    """Bad input: an argument, array, plan or file kvcanary refuses. A ``ValueError``, so
    ``pytest.raises(ValueError, match="kv-canary: ...")`` and ``except ValueError`` catch it.
    The tools' errors (:class:`ToolError`: ``DumpError``, ``AuditError``, ``SynthError``,
    ``CampaignError``, ``ExplainError``) are CanaryErrors
    whose message already starts with the file or option, so they carry no prefix."""


class CanaryTypeError(CanaryError, TypeError):
    """An input of the wrong kind (not an array, not an integer): also a ``TypeError``."""


class CanaryRuntimeError(Prefixed, RuntimeError):
    """The environment cannot run the request (no CUDA device, a kernel that did not
    compile): not bad input, so not a ValueError; same ``detail`` and ``key``."""


class ToolError(CanaryError):
    """A CanaryError of the tools (dump reader, explain...): the message starts with the
    file or option it names, so it carries no prefix (``str(err) == err.detail``)."""

    prefix = ""
