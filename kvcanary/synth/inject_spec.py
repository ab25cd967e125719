"""The ``--inject`` grammar of ``kvcanary synth`` (``KIND[:COUNT][@CLASS]``, ``all``, pair
shapes ``KIND+KIND@SHAPE``) read into ``(kind, count, target)`` triples, each checked against
the fault model (:mod:`.fault_kinds`) before anything is simulated."""

from __future__ import annotations

from .config import SynthError
from .fault_kinds import KINDS, check_kind_target, default_target, fault_kinds, kind_targets


def inapplicable_kinds(config) -> dict:
    """Fault kinds that cannot be injected into a workload of ``config``, with the reason."""
    if config.sources == 0:
        return {name: "no real-KV sources (--sources 0)" for name, kind in KINDS.items()
                if kind.needs_sources}
    return {}


def parse_inject(specs, config=None) -> list:
    """``["token", "alias:3@head"]`` -> ``[("token", 1, "interior"), ("alias", 3, "head")]``;
    kind ``all`` means every kind that applies to ``config`` (see :func:`inapplicable_kinds`),
    class ``all`` every target class the kind reaches; ``token+position:2@chain-seam`` places
    two interacting pairs (per-token runs). A paged ``config`` takes the paged kinds
    (:func:`fault_kinds`)."""
    skipped = inapplicable_kinds(config) if config is not None else {}
    paged = config is not None and config.paged
    result = []
    for spec in specs:
        body, _, target = spec.partition("@")
        kind, _, count = body.partition(":")
        kind, target = kind.strip(), target.strip()
        try:
            number = int(count) if count else 1
        except ValueError:
            raise SynthError(f"--inject {spec}: COUNT must be an integer") from None
        if number < 1:
            raise SynthError(f"--inject {spec}: COUNT must be at least 1")
        kinds = ([k for k in fault_kinds(paged) if k not in skipped] if kind == "all"
                 else (kind,))
        for name in kinds:
            targets = (kind_targets(name) if target == "all" and name in fault_kinds(True)
                       else (target or default_target(name),))
            for where in targets:
                check_kind_target(name, where, paged)
                result.append((name, number, where))
    return result
