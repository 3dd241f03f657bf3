"""A run's latencies as one self-contained HTML page (``--forkd-report=PATH``).

A table of numbers answers "did it pass"; a histogram answers "where do
the slow ones sit, and how close is the budget". The page holds, for one
run: the latency table (the terminal summary's, with p99), a histogram per
operation on a log-scale axis with its budgets drawn as lines (and the
baseline's p95 when the run was compared), the comparison with the
baseline, the slowest tests, and the snapshot builds (never budgeted).

Everything is in the one file: CSS inline, charts drawn here as SVG, and a
few lines of script that only check the charts were laid out (the page
marks ``<html data-forkd-charts="N">`` once N charts have a non-zero size,
and each chart with its box, ``data-box="left,top,width,height"``, which the
browser test reads). No network access, no CDN: the file can be
kept as a CI artifact and opened years later.

This module knows nothing of pytest: :class:`ReportData` holds plain
values (see :mod:`pytest_forkd.plugin.html_report` for where they come from).
"""

from __future__ import annotations

import html
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from pytest_forkd.latency.budgets import Budget, Violation, describe_budgets
from pytest_forkd.latency.compare import Comparison
from pytest_forkd.latency.stats import Summary, summarize
from pytest_forkd.latency.timings import KNOWN_OPS, Sample

#: Bins of each histogram, spread evenly on the log axis.
BINS: Final = 28
#: Tests listed under "slowest tests".
SLOWEST: Final = 15

_WIDTH: Final = 540
_HEIGHT: Final = 210
_LEFT: Final = 44
_RIGHT: Final = 16
_TOP: Final = 34
_BOTTOM: Final = 36

_BAR: Final = "#4c78a8"
_SUITE_BUDGET: Final = "#d62728"
_TEST_BUDGET: Final = "#ff7f0e"
_BASELINE: Final = "#7b3294"
_QUANTILE: Final = "#555555"


@dataclass(frozen=True)
class TestTime:
    """One test's wall time (setup + call + teardown) and outcome, as pytest reported them."""

    nodeid: str
    seconds: float
    outcome: str


TestTime.__test__ = False  # type: ignore[attr-defined]  # a record, not a test class


@dataclass(frozen=True)
class ReportData:
    """What the report shows; every field is plain data gathered by the caller."""

    samples: Sequence[Sample]
    budgets: Sequence[Budget] = ()
    """Suite-wide budgets (``test`` None) and per-test ones (a marker's)."""
    violations: Sequence[Violation] = ()
    comparison: Comparison | None = None
    builds: Sequence[Mapping[str, object]] = ()
    """Snapshot builds: ``snapshot``, ``action`` (built or cached), ``seconds``, ``worker``."""
    tests: Sequence[TestTime] = ()
    context: Mapping[str, str] = field(default_factory=dict)
    """Lines of the header: engine, accelerator, backend, snapshot, outcome..."""
    title: str = "forkd latency report"


def write_report(path: Path | str, data: ReportData) -> Path:
    """Write the report to ``path`` (its directory is created), atomically; return the absolute path."""
    target = Path(path).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(render_report(data))
        os.chmod(temporary, 0o644)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


def render_report(data: ReportData) -> str:
    """The whole page as a string."""
    by_op = _by_op(data.samples)
    sections = [
        _header(data),
        _violations(data.violations),
        _latency_table(by_op, data),
        _histograms(by_op, data),
        _comparison(data.comparison),
        _slowest(data),
        _builds(data.builds),
    ]
    body = "\n".join(section for section in sections if section)
    return _PAGE.format(title=_e(data.title), style=_STYLE, body=body, script=_SCRIPT)


# -- sections ---------------------------------------------------------------------------------------------------
def _header(data: ReportData) -> str:
    items = "".join(f"<dt>{_e(key)}</dt><dd>{_e(value)}</dd>" for key, value in data.context.items())
    count = len(data.samples)
    return (
        f"<header><h1>{_e(data.title)}</h1>"
        f"<p class='lead'>{count} timed operation{'' if count == 1 else 's'} in "
        f"{len({s.op for s in data.samples})} kind{'' if len({s.op for s in data.samples}) == 1 else 's'}"
        f"{'' if not data.violations else f', <b class=bad>{len(data.violations)} budget violation(s)</b>'}"
        "</p>" + (f"<dl class='context'>{items}</dl>" if items else "") + "</header>"
    )


def _violations(violations: Sequence[Violation]) -> str:
    if not violations:
        return ""
    rows = "".join(
        "<tr>"
        f"<td>{_e(violation.scope)}</td>"
        f"<td>{_e(violation.budget.op + (f'[{violation.budget.backend}]' if violation.budget.backend else ''))}</td>"
        f"<td>{_e(violation.budget.stat)}</td>"
        f"<td class=num>{violation.measured_ms:.2f}</td>"
        f"<td class=num>{violation.budget.limit_ms:g}</td>"
        f"<td>{_e(violation.budget.source)}</td>"
        "</tr>"
        for violation in violations
    )
    return (
        "<section id='violations' class='alert'><h2>Budget violations</h2>"
        "<table><thead><tr><th>test</th><th>operation</th><th>stat</th><th>measured ms</th><th>budget ms</th>"
        f"<th>source</th></tr></thead><tbody>{rows}</tbody></table></section>"
    )


def _latency_table(by_op: Mapping[str, list[float]], data: ReportData) -> str:
    deltas = _deltas(data.comparison)
    violated = {violation.budget.op for violation in data.violations}
    rows = []
    for op, values in by_op.items():
        summary = summarize(values)
        status = " class=bad" if op in violated else ""
        rows.append(
            f"<tr{status}><td><a href='#hist-{_anchor(op)}'>{_e(op)}</a></td><td class=num>{summary.n}</td>"
            + "".join(f"<td class=num>{value:.1f}</td>" for value in _stats(summary))
            + f"<td>{_e(describe_budgets(op, data.budgets))}</td><td class=num>{_e(deltas.get(op, '-'))}</td></tr>"
        )
    if not rows:
        return "<section id='latency'><h2>Latency</h2><p>No forkd operation was timed in this run.</p></section>"
    return (
        "<section id='latency'><h2>Latency</h2><table><thead><tr><th>operation</th><th>n</th><th>p50 ms</th>"
        "<th>p95 ms</th><th>p99 ms</th><th>max ms</th><th>budget</th><th>delta p95</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
        "<p class=note>Snapshot builds are not in this table: they run once per cache, so they are shown apart "
        "and never count against budgets or baselines.</p></section>"
    )


def _histograms(by_op: Mapping[str, list[float]], data: ReportData) -> str:
    if not by_op:
        return ""
    baselines = _baseline_p95(data.comparison)
    charts = [
        f"<figure id='hist-{_anchor(op)}'><figcaption>{_e(op)} <span class=dim>(n={len(values)})</span>"
        f"</figcaption>{histogram_svg(op, values, data.budgets, baselines.get(op))}</figure>"
        for op, values in by_op.items()
    ]
    legend = (
        "<p class=legend><span class=key style='background:#4c78a8'></span>samples per bin "
        f"<span class=key style='background:{_SUITE_BUDGET}'></span>suite-wide budget "
        f"<span class=key style='background:{_TEST_BUDGET}'></span>a test's own budget (marker) "
        f"<span class=key style='background:{_BASELINE}'></span>baseline p95 "
        f"<span class=key style='background:{_QUANTILE}'></span>p50 / p95 of this run</p>"
    )
    return (
        "<section id='histograms'><h2>Distributions</h2><p class=note>Milliseconds on a log scale; "
        f"hover a bar for its range and count.</p>{legend}<div class=charts>{''.join(charts)}</div></section>"
    )


def _comparison(comparison: Comparison | None) -> str:
    if comparison is None:
        return ""
    rows = []
    shown = [
        row
        for row in comparison.rows
        if row.test is None or row.flagged or any(finding.regression or finding.exceeded for finding in row.findings)
    ]
    hidden = len(comparison.rows) - len(shown)
    for row in shown:
        verdict = row.verdict
        status = " class=bad" if verdict.startswith(("REGRESSION", "SLOWER")) else ""
        old, new = row.old, row.new
        cells = [
            _e(row.op),
            _e(row.test or "whole run"),
            f"{old.n if old else '-'}/{new.n if new else '-'}",
        ]
        for stat in ("p50", "p95", "max"):
            cells.append(
                f"{old.get(stat):.1f} &rarr; {new.get(stat):.1f}" if old and new else _e(_one(old or new, stat))
            )
        delta = new.get(comparison.delta_stat) - old.get(comparison.delta_stat) if old is not None and new else None
        cells.append(f"{delta:+.1f} ms" if delta is not None else "-")
        cells.append(_e(verdict))
        rows.append(f"<tr{status}>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    warnings = "".join(f"<li>{_e(warning)}</li>" for warning in comparison.warnings)
    return (
        f"<section id='comparison'><h2>Compared with {_e(comparison.baseline_label)}</h2>"
        + (f"<ul class=warn>{warnings}</ul>" if warnings else "")
        + "<table><thead><tr><th>operation</th><th>scope</th><th>n old/new</th><th>p50 ms</th><th>p95 ms</th>"
        f"<th>max ms</th><th>delta {_e(comparison.delta_stat)}</th><th>verdict</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
        + (
            f"<p class=note>{hidden} per-test row{'' if hidden == 1 else 's'} without a finding not shown "
            "(the terminal summary lists them all).</p>"
            if hidden
            else ""
        )
        + "</section>"
    )


def _slowest(data: ReportData) -> str:
    forkd_ms: dict[str, float] = {}
    operations: dict[str, int] = {}
    for sample in data.samples:
        if sample.test is not None:
            forkd_ms[sample.test] = forkd_ms.get(sample.test, 0.0) + sample.ms
            operations[sample.test] = operations.get(sample.test, 0) + 1
    tests = sorted(data.tests, key=lambda test: -test.seconds)[:SLOWEST]
    if not tests:
        return ""
    longest = max(test.seconds for test in tests) or 1.0
    rows = []
    for test in tests:
        width = max(0.5, 100 * test.seconds / longest)
        share = forkd_ms.get(test.nodeid, 0.0) / 1000
        inner = min(width, 100 * share / longest)
        status = " class=bad" if test.outcome == "failed" else ""
        rows.append(
            f"<tr{status}><td class=test>{_e(test.nodeid)}</td><td>{_e(test.outcome)}</td>"
            f"<td class=num>{test.seconds:.2f}</td><td class=num>{share:.2f}</td>"
            f"<td class=num>{operations.get(test.nodeid, 0)}</td>"
            f"<td class=barcell><div class=testbar style='width:{width:.1f}%'>"
            f"<div class=inner style='width:{(100 * inner / width) if width else 0:.1f}%'></div></div></td></tr>"
        )
    return (
        "<section id='slowest'><h2>Slowest tests</h2><p class=note>Wall time of setup, call and teardown; "
        "the dark part of the bar is the time spent in timed forkd operations.</p>"
        "<table><thead><tr><th>test</th><th>outcome</th><th>seconds</th><th>forkd s</th><th>operations</th>"
        f"<th class=barcell></th></tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


def _builds(builds: Sequence[Mapping[str, object]]) -> str:
    if not builds:
        return ""
    rows = "".join(
        f"<tr><td>{_e(build.get('snapshot'))}</td><td>{_e(build.get('action'))}</td>"
        f"<td class=num>{_seconds(build.get('seconds'), build.get('action'))}</td>"
        f"<td>{_e(build.get('worker', 'main'))}</td></tr>"
        for build in builds
    )
    return (
        "<section id='builds'><h2>Snapshot builds</h2><p class=note>Set-up commands of snapshots declared in "
        "forkd.yaml run once, when the snapshot is built; their timings are kept apart from the tests' and "
        "never count against budgets or baselines.</p><table><thead><tr><th>snapshot</th><th>action</th>"
        f"<th>seconds</th><th>worker</th></tr></thead><tbody>{rows}</tbody></table></section>"
    )


# -- the histogram ----------------------------------------------------------------------------------------------
def histogram_svg(op: str, values: Sequence[float], budgets: Sequence[Budget], baseline_p95: float | None) -> str:
    """One operation's samples as an SVG histogram on a log-scale millisecond axis, with its budget lines.

    The axis spans the samples and every line drawn (budgets, the baseline's
    p95), so a budget far above the samples still shows how much room is
    left. Lines: suite-wide budgets (solid red), the tests' own (dashed
    orange; one line per distinct limit), the baseline's p95 (dotted
    purple), this run's p50 and p95 (grey ticks above the bars).
    """
    positive = [max(value, 0.001) for value in values]
    summary = summarize(positive)
    lines: list[tuple[float, str, str, str]] = []  # (ms, colour, dash, label)
    suite = [budget for budget in budgets if budget.op == op and budget.test is None]
    for budget in suite:
        backend = f"[{budget.backend}]" if budget.backend else ""
        lines.append((budget.limit_ms, _SUITE_BUDGET, "", f"{budget.stat}{backend} \u2264 {budget.limit_ms:g}"))
    per_test: dict[float, int] = {}
    for budget in budgets:
        if budget.op == op and budget.test is not None:
            per_test[budget.limit_ms] = per_test.get(budget.limit_ms, 0) + 1
    for limit, count in sorted(per_test.items()):
        lines.append((limit, _TEST_BUDGET, "6 4", f"max \u2264 {limit:g} ({count} test{'' if count == 1 else 's'})"))
    if baseline_p95 is not None and baseline_p95 > 0:
        lines.append((baseline_p95, _BASELINE, "2 3", f"baseline p95 {baseline_p95:.1f}"))
    low = min([summary.min, *(line[0] for line in lines)])
    high = max([summary.max, *(line[0] for line in lines)])
    log_low, log_high = math.log10(low), math.log10(high)
    if log_high - log_low < 1:  # at least one decade, centred on the data
        middle = (log_low + log_high) / 2
        log_low, log_high = middle - 0.5, middle + 0.5
    pad = (log_high - log_low) * 0.04
    log_low, log_high = log_low - pad, log_high + pad
    plot_width = _WIDTH - _LEFT - _RIGHT
    plot_height = _HEIGHT - _TOP - _BOTTOM

    def x_of(ms: float) -> float:
        return _LEFT + (math.log10(max(ms, 1e-9)) - log_low) / (log_high - log_low) * plot_width

    counts = [0] * BINS
    step = (log_high - log_low) / BINS
    for value in positive:
        index = min(BINS - 1, max(0, int((math.log10(value) - log_low) / step)))
        counts[index] += 1
    tallest = max(counts)
    parts = [
        f"<svg class='chart' data-op='{_e(op)}' xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {_WIDTH} {_HEIGHT}' "
        f"width='{_WIDTH}' height='{_HEIGHT}' role='img' aria-label='histogram of {_e(op)} latencies'>",
        f"<rect x='{_LEFT}' y='{_TOP}' width='{plot_width}' height='{plot_height}' fill='#fafafa' stroke='#ddd'/>",
    ]
    parts += _axes(log_low, log_high, x_of, tallest, plot_height)
    parts.append("<g class='bars'>")
    for index, count in enumerate(counts):
        if not count:
            continue
        start, end = 10 ** (log_low + index * step), 10 ** (log_low + (index + 1) * step)
        left, right = x_of(start), x_of(end)
        height = plot_height * count / tallest
        parts.append(
            f"<rect class='bar' x='{left + 0.5:.1f}' y='{_TOP + plot_height - height:.1f}' "
            f"width='{max(1.0, right - left - 1):.1f}' height='{height:.1f}' fill='{_BAR}'>"
            f"<title>{_ms(start)}\u2013{_ms(end)} ms: {count} sample{'' if count == 1 else 's'}</title></rect>"
        )
    parts.append("</g>")
    close = x_of(summary.p95) - x_of(summary.p50) < 24  # one label for both, or they overlap
    for label, ms in (("p50", summary.p50), ("p95", summary.p95)):
        x = x_of(ms)
        text = "" if close and label == "p50" else ("p50 p95" if close else label)
        parts.append(
            f"<g class='quantile'><line x1='{x:.1f}' x2='{x:.1f}' y1='{_TOP - 6}' y2='{_TOP + plot_height}' "
            f"stroke='{_QUANTILE}' stroke-width='1' stroke-dasharray='1 3'/>"
            + (f"<text x='{x:.1f}' y='{_TOP - 8}' text-anchor='middle' class='q'>{text}</text>" if text else "")
            + f"<title>{label} {summary.get(label):.1f} ms</title></g>"
        )
    for row, (ms, colour, dash, label) in enumerate(lines):
        x = x_of(ms)
        anchor = "end" if x > _LEFT + plot_width * 0.7 else "start"
        offset = -4 if anchor == "end" else 4
        dash_attribute = f" stroke-dasharray='{dash}'" if dash else ""
        parts.append(
            f"<g class='budget'><line x1='{x:.1f}' x2='{x:.1f}' y1='{_TOP}' y2='{_TOP + plot_height}' "
            f"stroke='{colour}' stroke-width='2'{dash_attribute}/>"
            f"<text x='{x + offset:.1f}' y='{_TOP + 12 + 13 * row}' text-anchor='{anchor}' fill='{colour}' "
            f"class='label'>{_e(label)}</text><title>{_e(label)} ms</title></g>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _axes(log_low: float, log_high: float, x_of: Callable[[float], float], tallest: int, plot_height: int) -> list[str]:
    """Tick marks: powers of ten (and 2 and 5 when the axis spans few decades), counts on the left."""
    decades = log_high - log_low
    multipliers = (1, 2, 5) if decades <= 3.5 else (1,)
    parts = []
    baseline_y = _TOP + plot_height
    for exponent in range(math.floor(log_low), math.ceil(log_high) + 1):
        for multiplier in multipliers:
            ms = multiplier * 10.0**exponent
            if not log_low <= math.log10(ms) <= log_high:
                continue
            x = x_of(ms)
            grid = "#ccc" if multiplier == 1 else "#eee"
            parts.append(
                f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{_TOP}' y2='{baseline_y + 4}' stroke='{grid}'/>"
                f"<text x='{x:.1f}' y='{baseline_y + 16}' text-anchor='middle' class='tick'>{_ms(ms)}</text>"
            )
    parts.append(
        f"<text x='{_LEFT + (_WIDTH - _LEFT - _RIGHT) / 2:.0f}' y='{_HEIGHT - 4}' text-anchor='middle' "
        "class='axis'>milliseconds (log scale)</text>"
    )
    for fraction in (0.0, 0.5, 1.0):
        value = tallest * fraction
        if fraction and value != int(value):
            continue
        y = baseline_y - plot_height * fraction
        parts.append(f"<text x='{_LEFT - 6}' y='{y + 4:.1f}' text-anchor='end' class='tick'>{int(value)}</text>")
    return parts


# -- helpers ----------------------------------------------------------------------------------------------------
def _by_op(samples: Sequence[Sample]) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = {}
    for sample in samples:
        groups.setdefault(sample.op, []).append(sample.ms)
    order = {op: index for index, op in enumerate(KNOWN_OPS)}
    return {op: groups[op] for op in sorted(groups, key=lambda op: (order.get(op, len(order)), op))}


def _deltas(comparison: Comparison | None) -> dict[str, str]:
    if comparison is None:
        return {}
    return {
        row.op: f"{row.new.get(comparison.delta_stat) - row.old.get(comparison.delta_stat):+.1f} ms"
        for row in comparison.rows
        if row.test is None and row.old is not None and row.new is not None
    }


def _baseline_p95(comparison: Comparison | None) -> dict[str, float]:
    if comparison is None:
        return {}
    return {row.op: row.old.p95 for row in comparison.rows if row.test is None and row.old is not None}


def _stats(summary: Summary) -> tuple[float, float, float, float]:
    return (summary.p50, summary.p95, summary.p99, summary.max)


def _one(summary: Summary | None, stat: str) -> str:
    return "-" if summary is None else f"{summary.get(stat):.1f}"


def _seconds(value: object, action: object) -> str:
    if action == "cached" or not isinstance(value, (int, float)):
        return "-"
    return f"{value:.1f}"


def _ms(value: float) -> str:
    """Compact milliseconds for ticks and tooltips: 0.5, 3, 20, 1k, 2.5k."""
    if value >= 1000:
        thousands = value / 1000
        return f"{thousands:.0f}k" if thousands >= 10 or thousands == int(thousands) else f"{thousands:.1f}k"
    if value >= 10:
        return f"{value:.0f}"
    if value >= 1:
        return f"{value:.1f}".rstrip("0").rstrip(".")
    return f"{value:.2g}"


def _anchor(op: str) -> str:
    return "".join(character if character.isalnum() else "-" for character in op)


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


_PAGE: Final = """<!DOCTYPE html>
<html lang="en" data-forkd-charts="0">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
{body}
<footer>Written by pytest-forkd. Self-contained: no network access needed to view it.</footer>
<script>{script}</script>
</body>
</html>
"""

_STYLE: Final = """
:root { color-scheme: light; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       margin: 24px auto; max-width: 1360px; padding: 0 20px; color: #222; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #e3e3e3; padding-bottom: 4px; }
.lead { margin: 0 0 8px; color: #444; }
dl.context { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 8px 0; color: #444; }
dl.context dt { font-weight: 600; }
dl.context dd { margin: 0; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { text-align: left; padding: 4px 10px; border-bottom: 1px solid #eee; vertical-align: top; }
th { background: #f5f6f8; font-weight: 600; }
td.num { text-align: right; }
td.test { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12.5px; word-break: break-all; }
tr.bad td { color: #b00020; }
b.bad { color: #b00020; }
.alert { border: 1px solid #f3b3b3; background: #fff5f5; padding: 4px 14px 12px; border-radius: 6px; }
.note { color: #666; margin: 4px 0 10px; }
.dim { color: #888; font-weight: normal; }
.legend { color: #444; }
.legend .key { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 14px; vertical-align: -1px;
               border-radius: 2px; }
.charts { display: flex; flex-wrap: wrap; gap: 12px 24px; }
figure { margin: 0; }
figcaption { font-weight: 600; margin: 4px 0; }
svg.chart { display: block; max-width: 100%; height: auto; }
svg text { font: 11px system-ui, sans-serif; fill: #555; }
svg text.label { font-weight: 600; paint-order: stroke; stroke: #fff; stroke-width: 3px; }
svg text.q { fill: #555; font-size: 10px; }
svg text.axis { fill: #777; }
ul.warn { color: #8a5a00; }
td.barcell, th.barcell { width: 260px; }
.testbar { height: 12px; background: #a9c4e0; border-radius: 2px; }
.testbar .inner { height: 12px; background: #4c78a8; border-radius: 2px; }
footer { margin: 32px 0 8px; color: #999; font-size: 12px; }
"""

#: Marks the page once its charts have a size: the browser test reads ``data-forkd-charts``.
_SCRIPT: Final = """
(function () {
  function mark() {
    var drawn = 0;
    document.querySelectorAll('svg.chart').forEach(function (svg) {
      var box = svg.getBoundingClientRect();
      var bars = svg.querySelectorAll('rect.bar').length;
      svg.setAttribute('data-box', [box.left + window.scrollX, box.top + window.scrollY, box.width, box.height]
        .map(Math.round).join(','));
      svg.setAttribute('data-bars', String(bars));
      if (box.width > 0 && box.height > 0 && bars > 0) { drawn += 1; }
    });
    document.documentElement.setAttribute('data-forkd-charts', String(drawn));
  }
  if (document.readyState === 'loading') { document.addEventListener('DOMContentLoaded', mark); } else { mark(); }
})();
"""
