"""kvcanary: catch silent KV-cache corruption in LLM serving engines.

A byte-compatible, torch-free implementation of SGLang's KV canary: a numpy reference and
CUDA kernels (compiled at run time through CuPy) behind one API. Importing kvcanary
imports neither torch nor cupy."""

from .api.launches import PlanReport, VerifyPlanTooSmall, entries_needed, plan, verify, write
from .findings.attribution import LaunchFinding, MergedFinding, Merger, attribute, merge_findings
from .format.consts import (
    CANARY_CHAIN_ANCHOR,
    CANARY_SLOT_BYTES,
    MAX_REAL_KV_SOURCES,
    MAX_REAL_KV_SOURCES_LIMIT,
    FailReason,
    LaunchTag,
    RealKvHashMode,
)
from .findings.diagnosis import Diagnosis, diagnose
from .format.errors import CanaryError
from .format.hashing import CHAIN_HEAD, splitmix64, splitmix64_mix3
from .model.types import CanaryContext, RealKvSource, VerifyPlan, ViolationLog, WritePlan
from .format.violations import Violation

__version__ = "0.1.0"

__all__ = [
    "CANARY_CHAIN_ANCHOR",
    "CANARY_SLOT_BYTES",
    "CHAIN_HEAD",
    "MAX_REAL_KV_SOURCES",
    "MAX_REAL_KV_SOURCES_LIMIT",
    "CanaryContext",
    "CanaryError",
    "Diagnosis",
    "PlanReport",
    "FailReason",
    "LaunchFinding",
    "LaunchTag",
    "MergedFinding",
    "Merger",
    "RealKvHashMode",
    "RealKvSource",
    "VerifyPlan",
    "Violation",
    "VerifyPlanTooSmall",
    "ViolationLog",
    "WritePlan",
    "attribute",
    "diagnose",
    "entries_needed",
    "merge_findings",
    "plan",
    "splitmix64",
    "splitmix64_mix3",
    "verify",
    "write",
]
