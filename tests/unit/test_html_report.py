"""The HTML report's page: sections, log-scale histograms with budget lines, escaping, self-containment."""

from __future__ import annotations

import math
import re
from html.parser import HTMLParser

import pytest

from pytest_forkd.latency.budgets import Budget, Violation
from pytest_forkd.latency.compare import Comparison, ComparisonRow
from pytest_forkd.latency.html_report import BINS, ReportData, TestTime, histogram_svg, render_report, write_report
from pytest_forkd.latency.stats import summarize
from pytest_forkd.latency.timings import Sample

SUITE = Budget("fork", "p95", 300, source="forkd.yaml budgets.fork.p95_ms")
MARKER = Budget("exec", "max", 100, test="t.py::test_a", source="exec_ms=100, marker on t.py::test_a")


def sample_data(**changes: object) -> ReportData:
    samples = [Sample("fork", 150.0 + index * 10, test=f"t.py::test_{index % 3}") for index in range(12)]
    samples += [Sample("exec", 5.0 * (index + 1), test="t.py::test_a") for index in range(8)]
    fields: dict[str, object] = {
        "samples": samples,
        "budgets": [SUITE, MARKER],
        "builds": [{"snapshot": "web", "action": "built", "seconds": 3.4, "worker": "main"}],
        "tests": [TestTime("t.py::test_a", 1.5, "passed"), TestTime("t.py::test_b", 0.4, "failed")],
        "context": {"settings": "snapshot web"},
    }
    fields.update(changes)
    return ReportData(**fields)  # type: ignore[arg-type]


class Elements(HTMLParser):
    """Collects start tags with their attributes (the checks read the DOM, not the text)."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def of(self, tag: str, **wanted: str) -> list[dict[str, str | None]]:
        return [attrs for name, attrs in self.tags if name == tag and all(attrs.get(k) == v for k, v in wanted.items())]


def parsed(page: str) -> Elements:
    elements = Elements()
    elements.feed(page)
    return elements


def test_the_page_has_every_section_and_one_chart_per_operation():
    page = render_report(sample_data())
    elements = parsed(page)
    for section in ("latency", "histograms", "slowest", "builds"):
        assert elements.of("section", id=section), section
    assert [svg["data-op"] for svg in elements.of("svg", **{"class": "chart"})] == ["fork", "exec"]
    assert "max&lt;=100 in 1 test" in page  # the marker's budget shows in its operation's row
    assert "p95&lt;=300" in page
    assert not elements.of("section", id="comparison")  # no baseline, no comparison
    assert not elements.of("section", id="violations")


def test_the_page_needs_nothing_from_the_network():
    page = render_report(sample_data())
    elements = parsed(page)
    assert not elements.of("link") and not [attrs for tag, attrs in elements.tags if tag == "img"]
    assert all("src" not in attrs for tag, attrs in elements.tags if tag == "script")
    assert re.findall(r"https?://[^'\"]+", page) == ["http://www.w3.org/2000/svg"] * 2  # the SVG namespace only


def test_node_ids_and_labels_are_escaped():
    hostile = "t.py::test_x[<script>alert(1)</script>]"
    page = render_report(sample_data(tests=[TestTime(hostile, 1.0, "passed")]))
    assert "<script>alert(1)" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def bars_and_lines(svg: str) -> tuple[list[float], dict[str, float]]:
    """Bar left edges and heights, and the x of each budget line by its label."""
    elements = parsed(svg)
    heights = [float(attrs["height"] or 0) for attrs in elements.of("rect", **{"class": "bar"})]
    lines = {}
    for match in re.finditer(r"<g class='budget'><line x1='([0-9.]+)'.*?class='label'>([^<]+)</text>", svg):
        lines[match.group(2)] = float(match.group(1))
    return heights, lines


def test_histogram_counts_every_sample_and_draws_budgets_in_log_order():
    values = [1.0, 1.1, 10.0, 10.5, 11.0, 100.0]
    budgets = [
        Budget("exec", "p95", 50, source="cli"),
        Budget("exec", "max", 1000, test="t::a", source="marker"),
        Budget("exec", "max", 1000, test="t::b", source="marker"),
        Budget("fork", "p95", 5, source="another operation's"),
    ]
    svg = histogram_svg("exec", values, budgets, baseline_p95=20.0)
    heights, lines = bars_and_lines(svg)
    counts = [int(count) for count in re.findall(r"ms: ([0-9]+) samples?</title></rect>", svg)]
    assert sum(counts) == len(values)
    assert [height / max(heights) for height in heights] == pytest.approx([count / max(counts) for count in counts])
    assert set(lines) == {"p95 \u2264 50", "max \u2264 1000 (2 tests)", "baseline p95 20.0"}
    # log scale: 20 -> 50 -> 1000 are spaced by their logarithms, not linearly
    x20, x50, x1000 = lines["baseline p95 20.0"], lines["p95 \u2264 50"], lines["max \u2264 1000 (2 tests)"]
    assert x20 < x50 < x1000
    assert (x1000 - x50) / (x50 - x20) == pytest.approx(math.log10(1000 / 50) / math.log10(50 / 20), rel=0.01)
    assert len(parsed(svg).of("rect", **{"class": "bar"})) <= BINS


def test_a_single_sample_and_a_budget_far_away_still_draw():
    svg = histogram_svg("fork", [250.0], [Budget("fork", "max", 60000, source="cli")], None)
    heights, lines = bars_and_lines(svg)
    assert len(heights) == 1 and heights[0] > 0
    assert list(lines) == ["max \u2264 60000"]


def test_violations_and_the_comparison_are_shown():
    old = summarize([100.0, 110.0, 120.0, 130.0, 140.0])
    new = summarize([200.0, 210.0, 220.0, 230.0, 240.0])
    comparison = Comparison(rows=[ComparisonRow("fork", None, old, new, (), 5)], baseline_label="0003_main")
    page = render_report(sample_data(violations=[Violation(SUITE, 312.0, 12)], comparison=comparison))
    elements = parsed(page)
    assert elements.of("section", id="violations") and elements.of("section", id="comparison")
    assert "Compared with 0003_main" in page
    assert "+100.0 ms" in page  # delta p95 in the latency table and the comparison
    assert "baseline p95 138.0" in page  # the baseline's p95 as a line on the fork histogram


def test_a_run_without_timed_operations_says_so():
    page = render_report(ReportData(samples=[], tests=[TestTime("t.py::test_plain", 0.1, "passed")]))
    assert "No forkd operation was timed in this run." in page
    assert "t.py::test_plain" in page
    assert not parsed(page).of("svg")


def test_write_report_replaces_the_file_in_one_step(tmp_path):
    target = tmp_path / "nested" / "report.html"
    assert write_report(target, sample_data()) == target
    first = target.read_text(encoding="utf-8")
    assert first.startswith("<!DOCTYPE html>") and first.rstrip().endswith("</html>")
    write_report(target, sample_data(title="second"))
    assert "<title>second</title>" in target.read_text(encoding="utf-8")
    assert sorted(path.name for path in target.parent.iterdir()) == ["report.html"]  # no temporary file left
