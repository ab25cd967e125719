"""One renderer for every layout's report: text, markdown (what ``docs/coverage.md``
commits) and JSON."""

from __future__ import annotations

import json

from ..synth.fault_kinds import PAIRS_NOT_UNION
from .layouts import BYTES_PER_TOKEN, RULE_WORDS, RULES, designed
from .model import MAX_REPORTED, CampaignError, CampaignReport, Cell

HEADER = ["target", "fault kind", "mode", "injected", "detected", "rate",
          "sites checked (2+ rows)", "checks fired at the sites", "status"]
NUMERIC = ("injected", "detected", "rate", "sites checked (2+ rows)")
CLASS_HEADER = ["target", "injected", "designed to see", "detected", "rate",
                "not designed to see", "sites checked", "faults seen by 2+ request rows"]


def _fired_text(cell: Cell) -> str:
    return ", ".join(f"{label} {n}" for label, n in
                     sorted(cell.fired.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def table_rows(report: CampaignReport, backend: str, rules: str) -> list:
    """``[class, kind, mode, injected, detected, rate, sites, checks fired, status]`` per row."""
    rows = []
    for target, kind, mode, scope in report.form.cells():
        c = report.cell(backend, rules, target, kind, mode, scope)
        should, why = designed(kind, mode, scope, rules, target)
        name = f"{kind} ({scope})" if scope else kind
        if should:
            rate = f"{100.0 * c.detected / c.visible:.2f}%" if c.visible else "-"
            status = "designed to see" + ("" if c.detected == c.visible else
                                          f"; MISSED {c.visible - c.detected}")
            rows.append([target, name, mode, str(c.injected), str(c.detected), rate,
                         f"{c.sites} ({c.multi_row})", _fired_text(c), status])
        else:
            status = f"not designed to see: {why}" + (
                f"; {c.stray} with findings at a site" if c.stray else "")
            rows.append([target, name, mode, str(c.injected), "-", "n/a", "-",
                         _fired_text(c), status])
    return rows


def class_rows(report: CampaignReport, backend: str, rules: str, targets=None) -> list:
    """Totals per target class (or pair shape): ``CLASS_HEADER`` columns."""
    rows = []
    for target in report.form.targets if targets is None else targets:
        total = Cell()
        for (b, r, t, _, _, _), cell in report.cells.items():
            if (b, r, t) == (backend, rules, target):
                total.add(cell)
        rate = f"{100.0 * total.detected / total.visible:.2f}%" if total.visible else "-"
        rows.append([target, str(total.injected), str(total.visible), str(total.detected), rate,
                     str(total.injected - total.visible), str(total.sites),
                     str(total.multi_row)])
    return rows


DIAGNOSIS_HEADER = ["fault kind", "true cause", "target", "designed to see", "detected",
                    "findings at its sites", "naming the cause", "share",
                    "naming it or as alternative", "certain and wrong",
                    "faults wholly named", "other causes named"]


def diagnosis_rows(report: CampaignReport, backend: str, rules: str) -> list:
    """Detection and diagnosis side by side, per fault kind and target class (or pair
    shape), over modes and scopes: ``DIAGNOSIS_HEADER`` columns."""
    from .causes import TRUE_CAUSE

    form = report.form
    totals: dict = {}
    for (b, r, target, kind, _, _), cell in report.cells.items():
        if (b, r) == (backend, rules):
            totals.setdefault((kind, target), Cell()).add(cell)
    rows = []
    for kind in form.kinds:
        for target in form.targets + form.pair_shapes:
            c = totals.get((kind, target))
            if c is None or not c.visible:
                continue
            share = f"{100.0 * c.named / c.diagnosed:.1f}%" if c.diagnosed else "-"
            either = (f"{100.0 * c.named_or_alternative / c.diagnosed:.1f}%"
                      if c.diagnosed else "-")
            others = ", ".join(f"{cause} {n}" for cause, n in
                               sorted(c.causes.items(), key=lambda kv: (-kv[1], kv[0])))
            rows.append([kind, f"`{TRUE_CAUSE.get(kind, '?')}`", target, str(c.visible),
                         str(c.detected), str(c.diagnosed), str(c.named), share, either,
                         str(c.certain_wrong) if target not in form.pair_shapes else "n/a",
                         f"{c.faults_named}/{c.faults_diagnosed}",
                         others or "-"])
    return rows


def _summary_lines(report: CampaignReport) -> list:
    r, form = report, report.form
    ran = ", ".join(r.backends)
    skipped = "; ".join(f"{b} not run: {why}" for b, why in r.skipped_backends.items())
    total = sum(r.cell(r.backends[0], RULES[0], *cell).injected for cell in form.cells())
    classes = len(form.targets)
    lines = [
        f"seed {r.seed}, {r.faults_per_kind} faults per kind and mode at least, "
        f"{r.clean_runs} clean runs, {r.jobs} job(s), {r.elapsed_s:.1f} s on {r.machine}",
        f"backends: {ran}" + (f" ({skipped})" if skipped else ""),
        f"workloads: {r.fault_runs} fault runs in {r.rounds} round(s), {r.injections} "
        f"injections, {total} faults injected at {classes} target class"
        f"{'es' if classes != 1 else ''}, each audited on every backend with kvcanary's rules "
        f"and with --compat; {form.tables}, SWA on and off, 0-4 real-KV sources, modes "
        "none/partial/all",
    ]
    if form.clean_classes:
        census = ", ".join(f"{t} {r.clean_census[t]}" for t in form.targets)
        fewest = ", ".join(f"{t} {r.clean_census_min.get(t, 0)}" for t in form.clean_classes)
        lines.append(
            f"clean runs: {r.clean_runs - len(r.clean_missing)} of {r.clean_runs} verify shared "
            f"prefix-cache entries, a window head and a chunk boundary (fewest in one run: "
            f"{fewest}; {r.clean_replaced} sampled workloads without them replaced); entries "
            f"verified over all clean runs by class: {census}")
    lines += [
        f"false positives: {r.false_positive_count} ({r.clean_violations} violations in "
        f"{r.clean_audits} audits of {r.clean_runs} clean runs, {r.prefault_violations} in "
        f"{r.prefault_audits} audits of fault runs before injection, "
        f"{r.in_run_failures} in-run verify failures)",
        "fault runs by setting: " + "; ".join(
            f"{words} " + ", ".join(f"{value}: {r.mix[(name, value)]}" for value in values)
            for name, words, values in (form.mix_setting,
                                        ("swa_window", "SWA", ("off", "on")),
                                        ("sources", "real-KV sources", range(5)),
                                        ("bytes_per_token", "KV bytes per token",
                                         BYTES_PER_TOKEN))),
        f"unattributed findings: {r.unattributed}",
    ]
    return lines


def _verdict_lines(report: CampaignReport) -> list:
    failures = report.failures()
    if not failures:
        return ["PASS: every fault the canary is designed to see was detected (100%), "
                "0 false positives, no certain wrong cause"]
    lines = [f"FAIL: {len(failures)} target(s) missed"]
    lines += [f"- {f}" for f in failures[:MAX_REPORTED]]
    for miss in report.misses:
        lines.append(
            f"- missed {miss['kind']} at a {miss['target']} entry (mode {miss['mode']}, "
            f"{miss['backend']}, {miss['rules']}): "
            f"request row {miss['request_row']}, position {miss['position']}, slot "
            f"{miss['slot']}, detail {miss['detail']}; expected {'+'.join(miss['expected'])}, "
            f"fired {'+'.join(miss['fired']) or 'nothing'}; seed {miss['config']['seed']}; "
            f"reproduce: {miss['reproduce']}")
    if report.miss_count > len(report.misses):
        lines.append(f"- ... {report.miss_count - len(report.misses)} more misses (see --format json)")
    for wrong in report.certain_wrong:
        lines.append(
            f"- certain wrong cause for {wrong['kind']} at a {wrong['target']} entry (mode "
            f"{wrong['mode']}, {wrong['backend']}, {wrong['rules']}): named {wrong['named']}, "
            f"the fault is {wrong['true_cause']}; {wrong['finding']} at {wrong['at']}; "
            f"reproduce: {wrong['reproduce']}")
    for fp in report.false_positives:
        lines.append(f"- false positive in {fp['where']} ({fp['backend']}, {fp['rules']}): "
                     f"{fp['violations']} violation(s), first {fp['first']} at {fp['at']}; "
                     f"reproduce: {fp['reproduce']}")
    return lines


def _markdown_table(header: list, rows: list) -> list:
    out = ["| " + " | ".join(header) + " |",
           "| " + " | ".join("---" if i == 0 or header[i] in ("fault kind", "mode", "status",
                                                               "checks fired at the sites",
                                                               "true cause", "target",
                                                               "other causes named")
                             else "---:" for i in range(len(header))) + " |"]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return out


def render_markdown(report: CampaignReport) -> str:
    form = report.form
    out = ["## kvcanary coverage campaign" + form.title, ""]
    out += [f"- {line}" for line in _summary_lines(report)]
    for backend in report.backends:
        for rules in RULES:
            out += ["", f"### {backend} backend, {RULE_WORDS[rules]}: totals by target class", ""]
            out += _markdown_table(CLASS_HEADER, class_rows(report, backend, rules))
    if form.pair_shapes:
        out += ["", "### Interacting faults (pairs, each fault scored at its own sites)", ""]
        out += _markdown_table(["backend", "rules"] + CLASS_HEADER, [
            [backend, rules] + row for backend in report.backends for rules in RULES
            for row in class_rows(report, backend, rules, form.pair_shapes)])
        out += [""] + [f"- not paired: {a} + {b}: {why}"
                       for (a, b), why in PAIRS_NOT_UNION.items()]
    for backend in report.backends:
        for rules in RULES:
            out += ["", f"### {backend} backend, {RULE_WORDS[rules]}", ""]
            out += _markdown_table(HEADER, table_rows(report, backend, rules))
    out += ["", f"### Diagnoses: {report.backends[0]} backend, {RULE_WORDS[RULES[0]]}", "",
            "Each finding at a site where a visible fault must fire, counted under the cause "
            "its diagnosis names; \"certain and wrong\" counts findings that state another "
            "cause as certain (the campaign fails on any). Pair shapes are shown but not held "
            "to that: where two faults reach one entry, the truth is both.", ""]
    out += _markdown_table(DIAGNOSIS_HEADER, diagnosis_rows(report, report.backends[0],
                                                            RULES[0]))
    out += ["", "### False positives", "",
            "| backend | rules | clean-run audits | violations | pre-injection audits | violations |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    for backend in report.backends:
        for rules in RULES:
            clean = report.fp.get(("clean", backend, rules), [0, 0])
            prefault = report.fp.get(("prefault", backend, rules), [0, 0])
            out.append(f"| {backend} | {rules} | {clean[0]} | {clean[1]} | {prefault[0]} | "
                       f"{prefault[1]} |")
    out += ["", "### Verdict", ""] + _verdict_lines(report)
    return "\n".join(out) + "\n"


def render_text(report: CampaignReport) -> str:
    form = report.form
    out = ["kvcanary coverage campaign" + form.title]
    out += [f"  {line}" for line in _summary_lines(report)]
    for backend in report.backends:
        for rules in RULES:
            rows = [HEADER] + table_rows(report, backend, rules)
            widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
            out += ["", f"{backend} backend, {RULE_WORDS[rules]}:"]
            for n, row in enumerate(rows):
                cells = [row[i].rjust(widths[i]) if HEADER[i] in NUMERIC
                         else row[i].ljust(widths[i]) for i in range(len(widths))]
                out.append("  ".join(cells + [row[-1]]).rstrip())
                if n == 0:
                    out.append("-" * (sum(widths) + 2 * len(widths) + len("status")))
    if form.pair_shapes:
        out += ["", "interacting pairs:"]
        for backend in report.backends:
            for rules in RULES:
                for row in class_rows(report, backend, rules, form.pair_shapes):
                    out.append(f"  {backend} {rules} {row[0]}: {row[1]} faults, {row[3]} of "
                               f"{row[2]} detected ({row[4]})")
    certain_wrong = sum(c.certain_wrong for c in report.cells.values())
    diagnosed = sum(c.diagnosed for (b, r, *_), c in report.cells.items()
                    if (b, r) == (report.backends[0], RULES[0]))
    named = sum(c.named for (b, r, *_), c in report.cells.items()
                if (b, r) == (report.backends[0], RULES[0]))
    if diagnosed:
        out += ["", f"diagnoses ({report.backends[0]}, {RULES[0]} rules): {named} of "
                f"{diagnosed} findings at the faults' sites name the fault's cause "
                f"({100.0 * named / diagnosed:.1f}%); {certain_wrong} state a certain wrong "
                "cause (any backend and rules)"]
    out += [""] + _verdict_lines(report)
    return "\n".join(out) + "\n"


def render(report: CampaignReport, fmt: str) -> str:
    """The report as ``text``, ``markdown`` or ``json``."""
    if fmt == "markdown":
        return render_markdown(report)
    if fmt == "json":
        return json.dumps(report.to_dict(), indent=2) + "\n"
    if fmt == "text":
        return render_text(report)
    raise CampaignError(f"--format must be text, markdown or json, got {fmt!r}")
