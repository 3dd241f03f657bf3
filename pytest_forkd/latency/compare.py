"""Noise-aware comparison of two benchmark runs (:mod:`pytest_forkd.latency.runs`).

A comparison goes further than pytest-benchmark's threshold check, because
VM latencies on CI machines are noisy: an operation counts as a regression
only when both runs have enough samples, the threshold on the statistic is
exceeded, *and* a permutation test says the new samples are slower beyond
chance (:func:`pytest_forkd.latency.stats.slower_p_value`), with Holm's correction
for the number of operations and tests checked at once. A change of several
times the measured noise of the statistic (:data:`~pytest_forkd.latency.stats.NOISE_FACTOR`,
:func:`~pytest_forkd.latency.stats.noise_multiple`) is always flagged, and is a
regression when it exceeds a threshold, whatever the permutation test could
resolve: with enough samples, +425% on a fork p95 is no accident.

Runs from different machines, accelerators, backends or QEMU versions are
not comparable: :func:`compare` warns, and refuses with ``strict=True``
(:class:`IncomparableRuns`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from pytest_forkd.errors import ConfigError, IncomparableRuns
from pytest_forkd.latency.runs import find_baseline, load_run, op_order, storage_dir
from pytest_forkd.latency.stats import NOISE_FACTOR, STAT_NAMES, Summary, noise_multiple, slower_p_value, summarize
from pytest_forkd.tables import render_table

DEFAULT_MIN_SAMPLES: Final = 5
DEFAULT_ALPHA: Final = 0.05
_MIN_RESAMPLES: Final = 1000
#: The smallest p-value a permutation test can give is 1 / (resamples + 1);
#: make it this many times smaller than the strictest Holm level alpha / checks.
_RESOLUTION: Final = 2

_COMPARE_FAIL: Final = re.compile(r"^\s*(?P<stat>[a-z0-9]+)\s*:\s*(?P<amount>[0-9]*\.?[0-9]+)\s*(?P<unit>%|ms)?\s*$")
_COMPARE_FAIL_FORMS: Final = (
    "STAT:N% (relative, e.g. p95:20%) or STAT:N / STAT:Nms (absolute milliseconds, e.g. p50:5ms), "
    f"where STAT is one of {', '.join(STAT_NAMES)}"
)
#: machine_info fields that make latencies incomparable when they differ.
_MACHINE_KEYS: Final = ("system", "machine", "cpu", "cores", "memory_mib", "kernel", "python", "qemu")


# --- comparing two runs ----------------------------------------------------------------


@dataclass(frozen=True)
class Threshold:
    """How much slower a statistic may get: ``amount`` percent or milliseconds."""

    stat: str
    amount: float
    relative: bool
    expression: str

    def exceeded(self, old: float, new: float) -> bool:
        if self.relative:
            return new > old * (1 + self.amount / 100.0) if old > 0 else new > old
        return new - old > self.amount

    def __str__(self) -> str:
        return self.expression


def parse_compare_fail(expression: str) -> Threshold:
    """Parse ``p95:20%`` (relative) or ``p50:5ms`` / ``p50:5`` (absolute ms)."""
    match = _COMPARE_FAIL.match(expression)
    if not match or match["stat"] not in STAT_NAMES:
        raise ConfigError(f"invalid compare-fail expression {expression!r}: expected {_COMPARE_FAIL_FORMS}")
    relative = match["unit"] == "%"
    canonical = f"{match['stat']}:{match['amount']}{'%' if relative else 'ms'}"
    return Threshold(match["stat"], float(match["amount"]), relative, canonical)


@dataclass(frozen=True)
class Finding:
    """One threshold checked on one operation (of the whole run or of one test).

    ``old``/``new`` are the statistic in the baseline and current run;
    ``p_value`` is the permutation test's (only run when the threshold is
    exceeded) and ``p_limit`` the Holm-corrected level it had to be below.
    """

    op: str
    test: str | None
    threshold: Threshold
    old: float
    new: float
    exceeded: bool
    p_value: float | None = None
    p_limit: float | None = None
    regression: bool = False
    noise_multiple: float | None = None
    """How many times the measured noise the change is (see :func:`pytest_forkd.latency.stats.noise_multiple`)."""

    @property
    def beyond_noise(self) -> bool:
        """The change is at least :data:`~pytest_forkd.latency.stats.NOISE_FACTOR` times the measured noise."""
        return self.noise_multiple is not None and self.noise_multiple >= NOISE_FACTOR

    @property
    def delta_ms(self) -> float:
        return self.new - self.old

    @property
    def delta_pct(self) -> float | None:
        return (self.new - self.old) / self.old * 100.0 if self.old > 0 else None

    def __str__(self) -> str:
        scope = self.test or "whole run"
        if self.regression and self.p_value is not None and self.p_limit is not None and self.p_value < self.p_limit:
            verdict = f"exceeds {self.threshold} and is significant (p={self.p_value:.2g} < {self.p_limit:.2g})"
        elif self.regression:
            verdict = f"exceeds {self.threshold} and is {self.noise_multiple:.1f}x the measured noise"
        elif self.exceeded:
            verdict = (
                f"exceeds {self.threshold} but is within noise (p={self.p_value:.2g}, needed < {self.p_limit:.2g})"
            )
        else:
            verdict = f"within {self.threshold}"
        return (
            f"{scope}: {self.op} {self.threshold.stat} {_ms(self.old)} -> {_ms(self.new)} ms, "
            f"{_delta(self.old, self.new)}: {verdict}"
        )


@dataclass(frozen=True)
class ComparisonRow:
    """One operation of the whole run or of one test, in both runs."""

    op: str
    test: str | None
    old: Summary | None
    new: Summary | None
    findings: tuple[Finding, ...]
    min_samples: int
    noise_multiple: float | None = None
    """The change of the comparison's delta statistic in multiples of its measured noise."""
    noise_stat: str = "p95"

    @property
    def flagged(self) -> bool:
        """Slower by at least :data:`~pytest_forkd.latency.stats.NOISE_FACTOR` times the measured noise."""
        return self.sufficient and self.noise_multiple is not None and self.noise_multiple >= NOISE_FACTOR

    @property
    def sufficient(self) -> bool:
        return (
            self.old is not None
            and self.new is not None
            and self.old.n >= self.min_samples
            and self.new.n >= self.min_samples
        )

    @property
    def verdict(self) -> str:
        if self.old is None:
            return "new"
        if self.new is None:
            return "missing"
        if not self.sufficient:
            return f"insufficient samples (need {self.min_samples})"
        regressed = [f.threshold.expression for f in self.findings if f.regression]
        if regressed:
            return "REGRESSION " + ", ".join(regressed)
        if self.flagged:
            return f"SLOWER {self.noise_stat} {self.noise_multiple:.1f}x the noise"
        noisy = [f for f in self.findings if f.exceeded]
        if noisy:
            return "slower, not significant " + ", ".join(f"{f.threshold} p={f.p_value:.2g}" for f in noisy)
        return "ok"


@dataclass
class Comparison:
    """Result of comparing a run with its baseline; ``regressions`` fail CI."""

    rows: list[ComparisonRow] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    baseline_label: str = "baseline"
    current_label: str = "current run"
    delta_stat: str = "p95"
    environment_differences: list[str] = field(default_factory=list)
    """Machine, accelerator, backend or QEMU version differences between the runs (see :func:`run_environment`)."""

    @property
    def regressions(self) -> list[Finding]:
        return [finding for row in self.rows for finding in row.findings if finding.regression]

    @property
    def flagged(self) -> list[ComparisonRow]:
        """Rows slower by several times the measured noise, whether or not a threshold fails them."""
        return [row for row in self.rows if row.flagged]

    def format_table(self) -> str:
        """A plain-text table (n, p50, p95, max of both runs, delta, verdict), then the regressions."""
        if not self.rows:
            return "nothing to compare"
        header = [
            "operation",
            "n old/new",
            "p50 ms",
            "p95 ms",
            "max ms",
            f"delta {self.delta_stat}",
            "verdict",
            "scope",
        ]
        lines = [header]
        for row in self.rows:
            lines.append(
                [
                    row.op,
                    f"{_n(row.old)}/{_n(row.new)}",
                    _pair(row, "p50"),
                    _pair(row, "p95"),
                    _pair(row, "max"),
                    _delta(row.old.get(self.delta_stat), row.new.get(self.delta_stat)) if row.old and row.new else "-",
                    row.verdict,
                    row.test or "whole run",
                ]
            )
        rendered = [f"{self.current_label} compared with {self.baseline_label}:", render_table(lines)]
        rendered += [f"REGRESSION: {finding}" for finding in self.regressions]
        regressed = {(finding.op, finding.test) for finding in self.regressions}
        rendered += [
            f"SLOWER: {row.test or 'whole run'}: {row.op} {row.noise_stat} {_ms(row.old.get(row.noise_stat))} -> "
            f"{_ms(row.new.get(row.noise_stat))} ms, {_delta(row.old.get(row.noise_stat), row.new.get(row.noise_stat))}"
            f", {row.noise_multiple:.1f}x the measured noise"
            for row in self.flagged
            if (row.op, row.test) not in regressed and row.old is not None and row.new is not None
        ]
        return "\n".join(rendered)


def _ms(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _delta(old: float, new: float) -> str:
    text = f"{'+' if new >= old else '-'}{_ms(abs(new - old))} ms"
    if old > 0:
        text += f" ({(new - old) / old * 100:+.1f}%)"
    return text


def _n(summary: Summary | None) -> str:
    return str(summary.n) if summary else "-"


def _pair(row: ComparisonRow, stat: str) -> str:
    old = _ms(row.old.get(stat)) if row.old else "-"
    new = _ms(row.new.get(stat)) if row.new else "-"
    return f"{old} -> {new}"


def _samples(section: object) -> list[float] | None:
    samples = section.get("samples") if isinstance(section, Mapping) else None
    return [float(v) for v in samples] if samples else None


def _row(
    op: str,
    test: str | None,
    old: list[float] | None,
    new: list[float] | None,
    thresholds: Sequence[Threshold],
    min_samples: int,
) -> ComparisonRow:
    """A row with its thresholds checked; significance is judged later, over all rows."""
    old_summary = summarize(old) if old else None
    new_summary = summarize(new) if new else None
    row = ComparisonRow(op, test, old_summary, new_summary, (), min_samples)
    if not row.sufficient:
        return row
    assert old_summary is not None and new_summary is not None
    assert old is not None and new is not None
    findings = []
    for threshold in thresholds:
        old_value, new_value = old_summary.get(threshold.stat), new_summary.get(threshold.stat)
        findings.append(
            Finding(
                op,
                test,
                threshold,
                old_value,
                new_value,
                threshold.exceeded(old_value, new_value),
                noise_multiple=noise_multiple(old, new, threshold.stat),
            )
        )
    noise_stat = thresholds[0].stat if thresholds else "p95"
    return replace(
        row, findings=tuple(findings), noise_stat=noise_stat, noise_multiple=noise_multiple(old, new, noise_stat)
    )


def _judge_significance(
    rows: list[ComparisonRow], samples: list[tuple[list[float], list[float]]], alpha: float
) -> list[ComparisonRow]:
    """Run the permutation test on every exceeded threshold and decide with Holm's method.

    A comparison checks many operations and tests at once; at p < alpha each,
    some would fail by chance alone on most runs. Holm's step-down over every
    check made (a threshold that is not exceeded counts as p = 1) keeps the
    chance that the comparison as a whole reports a false regression below
    ``alpha``. Cost stays low in two stages: a short test drops what is not
    even significant at ``alpha``, then the few survivors get enough resamples
    to resolve their stricter Holm levels.
    """
    checks = sum(len(row.findings) for row in rows)
    exceeded = [(r, f) for r, row in enumerate(rows) for f, finding in enumerate(row.findings) if finding.exceeded]
    if not exceeded:
        return rows

    def p_value(key: tuple[int, int], resamples: int, stop_above: float) -> float:
        stat = rows[key[0]].findings[key[1]].threshold.stat
        return slower_p_value(*samples[key[0]], stat, stop_above=stop_above, resamples=resamples)

    p_values = {key: p_value(key, _MIN_RESAMPLES, alpha) for key in exceeded}
    survivors = [key for key in exceeded if p_values[key] < alpha]
    # Survivors rank first, so the loosest level any of them can face is this one.
    loosest_level = alpha / (checks - len(survivors) + 1)
    resamples = math.ceil(_RESOLUTION * checks / alpha)
    if survivors and resamples > _MIN_RESAMPLES:
        for key in survivors:
            p_values[key] = p_value(key, resamples, loosest_level)

    judged = [list(row.findings) for row in rows]
    rejecting = True
    for rank, (r, f) in enumerate(sorted(exceeded, key=lambda key: p_values[key])):
        level = alpha / (checks - rank)
        rejecting = rejecting and p_values[(r, f)] < level
        finding = judged[r][f]
        judged[r][f] = replace(
            finding, p_value=p_values[(r, f)], p_limit=level, regression=rejecting or finding.beyond_noise
        )
    return [replace(row, findings=tuple(findings)) for row, findings in zip(rows, judged, strict=True)]


def _as_mapping(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def _differences(old: object, new: object, keys: Iterable[str] | None, prefix: str) -> list[str]:
    old_map = old if isinstance(old, Mapping) else {}
    new_map = new if isinstance(new, Mapping) else {}
    names = keys if keys is not None else sorted(set(old_map) | set(new_map), key=str)
    return [
        f"{prefix}.{key}: {old_map.get(key)!r} in the baseline, {new_map.get(key)!r} now"
        for key in names
        if old_map.get(key) != new_map.get(key)
    ]


#: machine_info fields that identify the hardware a run measured.
_HARDWARE_KEYS: Final = ("system", "machine", "cpu", "cores", "memory_mib")
#: What makes latencies of two runs incomparable, in the order differences are named.
ENVIRONMENT_KEYS: Final = ("machine", "accelerator", "backend", "QEMU version")


def run_environment(document: Mapping[str, object]) -> dict[str, object]:
    """The machine, accelerator, backend(s) and QEMU version a stored run measured.

    The backends are the run's chosen backend (``conditions.backend``) and
    every backend its samples name, so a test that switched backend by marker
    counts too. Fields the run did not record are None.
    """
    machine_info = document.get("machine_info")
    machine_info = machine_info if isinstance(machine_info, Mapping) else {}
    conditions = document.get("conditions")
    conditions = conditions if isinstance(conditions, Mapping) else {}
    hardware = {key: machine_info[key] for key in _HARDWARE_KEYS if machine_info.get(key) is not None}
    backends = {str(conditions["backend"])} if conditions.get("backend") else set()
    samples = document.get("samples")
    for sample in samples if isinstance(samples, list) else []:
        if isinstance(sample, Mapping) and isinstance(sample.get("backend"), str) and sample["backend"]:
            backends.add(sample["backend"])
    return {
        "machine": hardware or None,
        "accelerator": conditions.get("accel"),
        "backend": ", ".join(sorted(backends)) or None,
        "QEMU version": machine_info.get("qemu") or conditions.get("qemu"),
    }


def environment_differences(baseline_doc: Mapping[str, object], current_doc: Mapping[str, object]) -> list[str]:
    """What differs between two runs' machine, accelerator, backend and QEMU version, one line each."""
    old, new = run_environment(baseline_doc), run_environment(current_doc)
    differences = []
    for key in ENVIRONMENT_KEYS:
        if old[key] == new[key]:
            continue
        before, after = old[key], new[key]
        if key == "machine" and isinstance(before, Mapping) and isinstance(after, Mapping):
            fields = [name for name in _HARDWARE_KEYS if before.get(name) != after.get(name)]
            detail = ", ".join(f"{name} {before.get(name)!r} -> {after.get(name)!r}" for name in fields)
            differences.append(f"machine: {detail}")
        else:
            differences.append(f"{key}: {old[key]!r} in the baseline, {new[key]!r} now")
    return differences


def compare(
    baseline_doc: Mapping[str, object],
    current_doc: Mapping[str, object],
    thresholds: Sequence[Threshold] = (),
    *,
    min_samples: int = DEFAULT_MIN_SAMPLES,
    alpha: float = DEFAULT_ALPHA,
    baseline_label: str = "baseline",
    current_label: str = "current run",
    strict: bool = False,
) -> Comparison:
    """Compare every operation of the whole run, and of each test present in both runs.

    A threshold only yields a regression when both sides have at least
    ``min_samples`` samples (otherwise the row says "insufficient samples" and
    nothing fails), the threshold is exceeded, and the one-sided permutation
    test says the new samples are slower at level ``alpha`` for the comparison
    as a whole (Holm's correction over all exceeded thresholds, so a suite with
    many operations and tests does not fail by chance). Differences in machine
    or conditions between the runs become warnings, since they change
    latencies more than code does; with ``strict`` a difference in machine,
    accelerator, backend or QEMU version raises :class:`IncomparableRuns`
    instead.
    """
    environment = environment_differences(baseline_doc, current_doc)
    if environment and strict:
        raise IncomparableRuns(
            f"refusing to compare {current_label} with {baseline_label}: they ran on a different "
            f"{' and '.join(item.split(':', 1)[0] for item in environment)} ({'; '.join(environment)}), "
            "so their latencies say nothing about the code; compare with a run of the same machine, accelerator, "
            "backend and QEMU version, or compare without strict mode to get a warning instead"
        )
    differences = _differences(
        baseline_doc.get("machine_info"), current_doc.get("machine_info"), _MACHINE_KEYS, "machine_info"
    ) + _differences(baseline_doc.get("conditions"), current_doc.get("conditions"), None, "conditions")
    # recipe hashes of the snapshots both runs used: a rebuilt snapshot changes latencies too
    old_recipes, new_recipes = _as_mapping(baseline_doc.get("snapshots")), _as_mapping(current_doc.get("snapshots"))
    differences += _differences(old_recipes, new_recipes, sorted(set(old_recipes) & set(new_recipes)), "snapshots")
    warnings = (
        [
            f"{baseline_label} and {current_label} ran under different conditions, "
            f"so latency changes may not come from the code: {'; '.join(differences)}"
        ]
        if differences
        else []
    )
    uncovered = [
        item
        for item in environment
        if item.startswith("backend:")
        and not any(difference.startswith("conditions.backend:") for difference in differences)
    ]
    if uncovered:
        warnings.append(
            f"{baseline_label} and {current_label} used different storage backends, "
            f"so latency changes may not come from the code: {'; '.join(uncovered)}"
        )

    def sections(document: Mapping[str, object], key: str) -> Mapping[str, object]:
        value = document.get(key)
        return value if isinstance(value, Mapping) else {}

    pairs: list[tuple[str, str | None, list[float] | None, list[float] | None]] = []
    old_ops, new_ops = sections(baseline_doc, "operations"), sections(current_doc, "operations")
    for op in sorted(set(old_ops) | set(new_ops), key=op_order):
        pairs.append((op, None, _samples(old_ops.get(op)), _samples(new_ops.get(op))))
    old_tests, new_tests = sections(baseline_doc, "tests"), sections(current_doc, "tests")
    for test in sorted(set(old_tests) & set(new_tests)):
        old_test, new_test = old_tests[test], new_tests[test]
        if not isinstance(old_test, Mapping) or not isinstance(new_test, Mapping):
            continue
        for op in sorted(set(old_test) & set(new_test), key=op_order):
            pairs.append((op, test, _samples(old_test[op]), _samples(new_test[op])))
    rows = [_row(op, test, old, new, thresholds, min_samples) for op, test, old, new in pairs]
    rows = _judge_significance(rows, [(old or [], new or []) for _, _, old, new in pairs], alpha)
    return Comparison(
        rows=rows,
        warnings=warnings,
        baseline_label=baseline_label,
        current_label=current_label,
        delta_stat=thresholds[0].stat if thresholds else "p95",
        environment_differences=environment,
    )


def compare_with_baseline(
    root: str | os.PathLike[str],
    current_doc: Mapping[str, object],
    thresholds: Sequence[Threshold] = (),
    ref: str | None = None,
    *,
    min_samples: int = DEFAULT_MIN_SAMPLES,
    alpha: float = DEFAULT_ALPHA,
    strict: bool = False,
) -> Comparison:
    """Compare ``current_doc`` with the stored run ``ref`` (see :func:`find_baseline`).

    Without a baseline there is nothing to fail on: the result has no rows and
    one warning saying what was looked for and where, for the caller to print.
    ``ref`` may also be a directory of shard runs, merged into one baseline.
    """
    if ref is not None and Path(ref).is_dir():
        from pytest_forkd.latency.shards import load_runs

        return compare(
            load_runs([ref]),
            current_doc,
            thresholds,
            min_samples=min_samples,
            alpha=alpha,
            baseline_label=f"shard runs in {ref}",
        )
    path = find_baseline(root, ref)
    if path is None:
        wanted = "stored run" if ref is None else f"stored run matching {str(ref)!r}"
        return Comparison(
            warnings=[
                f"comparison skipped: no {wanted} in {storage_dir(root)}; "
                "save a run on this kind of machine first to create a baseline"
            ]
        )
    return compare(
        load_run(path),
        current_doc,
        thresholds,
        min_samples=min_samples,
        alpha=alpha,
        baseline_label=path.stem,
        strict=strict,
    )
