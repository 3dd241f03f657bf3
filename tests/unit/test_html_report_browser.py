"""The HTML report in a real browser: headless Chromium lays out and paints every chart.

Skips, naming the package, where Chromium is missing (CI installs it:
``apt-get install -y chromium``). The DOM after the page's script ran says
how many charts have a size; the screenshot says they were painted: the
bars' and budget lines' colours are in each chart's box.
"""

from __future__ import annotations

import re

import pytest
from browser import WINDOW, dump_dom, screenshot

from pytest_forkd.latency.budgets import Budget, Violation
from pytest_forkd.latency.compare import Comparison, ComparisonRow
from pytest_forkd.latency.html_report import ReportData, TestTime, write_report
from pytest_forkd.latency.stats import summarize
from pytest_forkd.latency.timings import Sample

pytestmark = pytest.mark.slow

BAR = (0x4C, 0x78, 0xA8)
SUITE_BUDGET = (0xD6, 0x27, 0x28)


def a_run() -> ReportData:
    tests = [f"tests/test_agent.py::test_step[{index}]" for index in range(12)]
    samples = []
    for index, test in enumerate(tests):
        samples.append(Sample("fork", 180.0 + 17 * index, test=test))
        samples += [Sample("exec", 8.0 * (1 + (index * 7 + step) % 9), test=test) for step in range(4)]
    budgets = [
        Budget("fork", "p95", 300, source="forkd.yaml budgets.fork.p95_ms"),
        Budget("exec", "max", 2000, source="--forkd-budget exec.max=2000"),
        Budget("exec", "max", 100, test=tests[0], source="exec_ms=100, marker"),
    ]
    fork = [sample.ms for sample in samples if sample.op == "fork"]
    comparison = Comparison(
        rows=[ComparisonRow("fork", None, summarize([ms * 0.8 for ms in fork]), summarize(fork), (), 5)],
        baseline_label="0001_main",
    )
    return ReportData(
        samples=samples,
        budgets=budgets,
        violations=[Violation(budgets[0], 361.0, len(fork))],
        comparison=comparison,
        builds=[{"snapshot": "web", "action": "built", "seconds": 4.2, "worker": "main"}],
        tests=[TestTime(test, 0.5 + index / 10, "passed") for index, test in enumerate(tests)],
        context={"settings": "snapshot web, backend diff"},
    )


def test_chromium_draws_every_chart_of_the_report(tmp_path):
    page = write_report(tmp_path / "report.html", a_run())
    dom = dump_dom(page)
    assert re.search(r'<html[^>]* data-forkd-charts="2"', dom), dom[:300]
    boxes = {
        op: tuple(int(value) for value in box.split(","))
        for op, box in re.findall(r'<svg[^>]*data-op="([^"]+)"[^>]*data-box="([^"]+)"', dom)
    }
    assert set(boxes) == {"fork", "exec"}
    for op, (_, _, width, height) in boxes.items():
        assert width > 200 and height > 80, (op, width, height)

    image = screenshot(page, tmp_path / "report.png")
    assert (image.width, image.height) == WINDOW
    for op, (left, top, width, height) in boxes.items():
        assert top + height <= image.height, f"chart {op} is below the screenshot"
        colours = image.colours(left, top, width, height)
        assert len(colours) > 20, f"chart {op} looks blank: {len(colours)} colours"  # bars, lines, anti-aliased text
        assert BAR in colours, f"no bar drawn in chart {op}"
    left, top, width, height = boxes["fork"]
    assert SUITE_BUDGET in image.colours(left, top, width, height), "the fork budget line is not drawn"
