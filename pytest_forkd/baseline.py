"""Stored runs and noise-aware comparison against a baseline.

The layout follows pytest-benchmark, so people find their way around:
``<root>/.forkd/benchmarks/<machine_id>/NNNN_<name>.json`` where ``NNNN``
counts up per folder and ``name`` defaults to the short commit id. Runs are
only comparable on the same kind of machine, hence one folder per machine id.

A comparison goes further than pytest-benchmark's threshold check, because
VM latencies on CI machines are noisy: an operation counts as a regression
only when both runs have enough samples, the threshold on the statistic is
exceeded, *and* a permutation test says the new samples are slower beyond
chance (:func:`pytest_forkd.stats.slower_p_value`), with Holm's correction
for the number of operations and tests checked at once.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Final

from filelock import FileLock

from .errors import ConfigError
from .paths import validate_tag
from .stats import STAT_NAMES, Summary, slower_p_value, summarize
from .timings import KNOWN_OPS, Recorder, Sample

FORMAT_VERSION: Final = 1
DEFAULT_MIN_SAMPLES: Final = 5
DEFAULT_ALPHA: Final = 0.05
_MIN_RESAMPLES: Final = 1000
#: The smallest p-value a permutation test can give is 1 / (resamples + 1);
#: make it this many times smaller than the strictest Holm level alpha / checks.
_RESOLUTION: Final = 2

_RUN_FILE: Final = re.compile(r"^(?P<counter>\d{4,})_(?P<name>.+)\.json$")
_COMPARE_FAIL: Final = re.compile(r"^\s*(?P<stat>[a-z0-9]+)\s*:\s*(?P<amount>[0-9]*\.?[0-9]+)\s*(?P<unit>%|ms)?\s*$")
_COMPARE_FAIL_FORMS: Final = (
    "STAT:N% (relative, e.g. p95:20%) or STAT:N / STAT:Nms (absolute milliseconds, e.g. p50:5ms), "
    f"where STAT is one of {', '.join(STAT_NAMES)}"
)
#: machine_info fields that make latencies incomparable when they differ.
_MACHINE_KEYS: Final = ("system", "machine", "cpu", "cores", "memory_mib", "kernel", "python", "qemu")


# --- where runs live -------------------------------------------------------------------


def machine_id() -> str:
    """pytest-benchmark's machine id, e.g. ``Linux-CPython-3.11-64bit``: stable per machine kind."""
    return "-".join(
        (
            platform.system(),
            platform.python_implementation(),
            ".".join(platform.python_version_tuple()[:2]),
            platform.architecture()[0],
        )
    )


def storage_dir(root: str | os.PathLike[str]) -> Path:
    """Folder holding this machine kind's runs of the project at ``root``."""
    return Path(root) / ".forkd" / "benchmarks" / machine_id()


def list_runs(root: str | os.PathLike[str]) -> list[Path]:
    """Stored runs of this machine kind, oldest (lowest counter) first."""
    folder = storage_dir(root)
    if not folder.is_dir():
        return []
    runs = [path for path in folder.iterdir() if path.is_file() and _RUN_FILE.match(path.name)]
    return sorted(runs, key=lambda path: (_counter(path), path.name))


def _counter(path: Path) -> int:
    return int(_run_file_parts(path)["counter"])


def _run_name(path: Path) -> str:
    return _run_file_parts(path)["name"]


def _run_file_parts(path: Path) -> re.Match[str]:
    match = _RUN_FILE.match(path.name)
    assert match is not None, path  # list_runs only returns matching names
    return match


def find_baseline(root: str | os.PathLike[str], ref: str | os.PathLike[str] | None = None) -> Path | None:
    """The stored run ``ref`` designates, or None when there is none.

    ``ref`` may be None (the latest run), a counter such as ``"0003"`` or
    ``"3"``, a run name such as ``"abc1234"`` (its latest run), a file stem such
    as ``"0003_abc1234"``, or the path of a run file. Compare before saving the
    current run, or the latest run is the current one.
    """
    runs = list_runs(root)
    if ref is None:
        return runs[-1] if runs else None
    candidate = Path(ref)
    if candidate.is_file():
        return candidate
    text = str(ref)
    if text.isdigit():
        matches = [path for path in runs if _counter(path) == int(text)]
    else:
        matches = [path for path in runs if text in (path.stem, _run_name(path))]
    return matches[-1] if matches else None


# --- what a run records ----------------------------------------------------------------


def machine_info(qemu_version: str | None = None) -> dict[str, object]:
    """Facts about the host that latencies depend on."""
    info: dict[str, object] = {
        "node": platform.node(),
        "system": platform.system(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_mib": _memory_mib(),
        "kernel": platform.release(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
    }
    if qemu_version:
        info["qemu"] = qemu_version
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_mib() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def commit_info(root: str | os.PathLike[str]) -> dict[str, object] | None:
    """Commit id, branch, dirtiness and commit time of the git checkout at ``root``.

    None when ``root`` is not in a git repository with a commit, or git is not
    installed. Untracked files do not count as dirty: the benchmark folder
    itself is usually untracked.
    """

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        commit_id = git("rev-parse", "HEAD")
        return {
            "id": commit_id,
            "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "time": git("log", "-1", "--format=%cI"),
        }
    except (OSError, subprocess.SubprocessError):
        return None


def _section(values: Sequence[float]) -> dict[str, object]:
    return {"summary": summarize(values).to_dict(), "samples": [round(v, 6) for v in values]}


def build_run(
    samples: Recorder | Iterable[Sample],
    *,
    root: str | os.PathLike[str] | None = None,
    conditions: Mapping[str, object] | None = None,
    qemu_version: str | None = None,
) -> dict[str, object]:
    """The JSON document of a run: machine, commit (from the checkout at ``root``),
    free-form ``conditions`` (accel, backend...), and per-operation and per-test
    summaries with their raw samples.
    """
    all_samples = samples.samples() if isinstance(samples, Recorder) else list(samples)
    by_op: dict[str, list[float]] = {}
    by_test: dict[str, dict[str, list[float]]] = {}
    for sample in all_samples:
        by_op.setdefault(sample.op, []).append(sample.ms)
        if sample.test is not None:
            by_test.setdefault(sample.test, {}).setdefault(sample.op, []).append(sample.ms)
    document: dict[str, object] = {
        "version": FORMAT_VERSION,
        "machine_info": machine_info(qemu_version),
    }
    commit = commit_info(root) if root is not None else None
    if commit is not None:
        document["commit_info"] = commit
    document.update(
        {
            "datetime": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "conditions": dict(conditions or {}),
            "operations": {op: _section(values) for op, values in _in_report_order(by_op)},
            "tests": {
                test: {op: _section(values) for op, values in _in_report_order(ops)}
                for test, ops in sorted(by_test.items())
            },
            "samples": [sample.to_dict() for sample in all_samples],
        }
    )
    return document


def _op_order(op: str) -> tuple[int, str]:
    return (KNOWN_OPS.index(op) if op in KNOWN_OPS else len(KNOWN_OPS), op)


def _in_report_order(groups: Mapping[str, list[float]]) -> list[tuple[str, list[float]]]:
    return sorted(groups.items(), key=lambda item: _op_order(item[0]))


def write_run(root: str | os.PathLike[str], document: Mapping[str, object], name: str | None = None) -> Path:
    """Store ``document`` as the next ``NNNN_<name>.json`` of this machine kind.

    ``name`` defaults to the document's short commit id, or ``unversioned``.
    The counter is taken under a file lock and the file appears atomically, so
    concurrent CI jobs on one machine neither collide nor read half a file.
    """
    if name is None:
        commit = document.get("commit_info")
        name = str(commit["id"])[:7] if isinstance(commit, Mapping) and commit.get("id") else "unversioned"
    validate_tag(name, "benchmark run name")
    folder = storage_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(folder / ".lock"):
        runs = list_runs(root)
        counter = _counter(runs[-1]) + 1 if runs else 1
        path = folder / f"{counter:04d}_{name}.json"
        partial = folder / f".{path.name}.partial"
        partial.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        os.replace(partial, path)
    return path


def save_run(
    root: str | os.PathLike[str],
    recorder_or_samples: Recorder | Iterable[Sample],
    name: str | None = None,
    conditions: Mapping[str, object] | None = None,
    *,
    qemu_version: str | None = None,
) -> Path:
    """Build the run document of ``recorder_or_samples`` and store it (see :func:`write_run`)."""
    document = build_run(recorder_or_samples, root=root, conditions=conditions, qemu_version=qemu_version)
    return write_run(root, document, name)


def load_run(path: str | os.PathLike[str]) -> dict[str, object]:
    """Read and validate a stored run; ConfigError says what is wrong with the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read benchmark run {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a forkd benchmark run (not UTF-8 text)") from None
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{path}: not a forkd benchmark run: invalid JSON ({exc})") from None
    _validate_run(document, str(path))
    return document


def _validate_run(document: object, where: str) -> None:
    hint = "expected a file written by pytest-forkd's run storage"
    if not isinstance(document, Mapping):
        raise ConfigError(f"{where}: not a forkd benchmark run: the top level is not an object; {hint}")
    version = document.get("version")
    if version != FORMAT_VERSION:
        raise ConfigError(
            f"{where}: unsupported benchmark run version {version!r}; this pytest-forkd reads version {FORMAT_VERSION}"
        )
    operations = document.get("operations")
    if not isinstance(operations, Mapping):
        raise ConfigError(f"{where}: operations: expected an object of operation name to samples; {hint}")
    _validate_sections(operations, f"{where}: operations")
    tests = document.get("tests", {})
    if not isinstance(tests, Mapping):
        raise ConfigError(f"{where}: tests: expected an object of test id to operations; {hint}")
    for test, sections in tests.items():
        if not isinstance(sections, Mapping):
            raise ConfigError(f"{where}: tests.{test}: expected an object of operation name to samples")
        _validate_sections(sections, f"{where}: tests.{test}")


def _validate_sections(sections: Mapping[object, object], where: str) -> None:
    for op, section in sections.items():
        samples = section.get("samples") if isinstance(section, Mapping) else None
        if not isinstance(samples, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in samples
        ):
            raise ConfigError(f"{where}.{op}.samples: expected a list of millisecond numbers")


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

    @property
    def delta_ms(self) -> float:
        return self.new - self.old

    @property
    def delta_pct(self) -> float | None:
        return (self.new - self.old) / self.old * 100.0 if self.old > 0 else None

    def __str__(self) -> str:
        scope = self.test or "whole run"
        if self.regression:
            verdict = f"exceeds {self.threshold} and is significant (p={self.p_value:.2g} < {self.p_limit:.2g})"
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

    @property
    def regressions(self) -> list[Finding]:
        return [finding for row in self.rows for finding in row.findings if finding.regression]

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
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        rendered = [f"{self.current_label} compared with {self.baseline_label}:"]
        rendered += [
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines
        ]
        rendered += [f"REGRESSION: {finding}" for finding in self.regressions]
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
    findings = []
    for threshold in thresholds:
        old_value, new_value = old_summary.get(threshold.stat), new_summary.get(threshold.stat)
        findings.append(Finding(op, test, threshold, old_value, new_value, threshold.exceeded(old_value, new_value)))
    return replace(row, findings=tuple(findings))


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
        judged[r][f] = replace(judged[r][f], p_value=p_values[(r, f)], p_limit=level, regression=rejecting)
    return [replace(row, findings=tuple(findings)) for row, findings in zip(rows, judged, strict=True)]


def _differences(old: object, new: object, keys: Iterable[str] | None, prefix: str) -> list[str]:
    old_map = old if isinstance(old, Mapping) else {}
    new_map = new if isinstance(new, Mapping) else {}
    names = keys if keys is not None else sorted(set(old_map) | set(new_map), key=str)
    return [
        f"{prefix}.{key}: {old_map.get(key)!r} in the baseline, {new_map.get(key)!r} now"
        for key in names
        if old_map.get(key) != new_map.get(key)
    ]


def compare(
    baseline_doc: Mapping[str, object],
    current_doc: Mapping[str, object],
    thresholds: Sequence[Threshold] = (),
    *,
    min_samples: int = DEFAULT_MIN_SAMPLES,
    alpha: float = DEFAULT_ALPHA,
    baseline_label: str = "baseline",
    current_label: str = "current run",
) -> Comparison:
    """Compare every operation of the whole run, and of each test present in both runs.

    A threshold only yields a regression when both sides have at least
    ``min_samples`` samples (otherwise the row says "insufficient samples" and
    nothing fails), the threshold is exceeded, and the one-sided permutation
    test says the new samples are slower at level ``alpha`` for the comparison
    as a whole (Holm's correction over all exceeded thresholds, so a suite with
    many operations and tests does not fail by chance). Differences in machine
    or conditions between the runs become warnings, since they change
    latencies more than code does.
    """
    differences = _differences(
        baseline_doc.get("machine_info"), current_doc.get("machine_info"), _MACHINE_KEYS, "machine_info"
    ) + _differences(baseline_doc.get("conditions"), current_doc.get("conditions"), None, "conditions")
    warnings = (
        [
            f"{baseline_label} and {current_label} ran under different conditions, "
            f"so latency changes may not come from the code: {'; '.join(differences)}"
        ]
        if differences
        else []
    )

    def sections(document: Mapping[str, object], key: str) -> Mapping[str, object]:
        value = document.get(key)
        return value if isinstance(value, Mapping) else {}

    pairs: list[tuple[str, str | None, list[float] | None, list[float] | None]] = []
    old_ops, new_ops = sections(baseline_doc, "operations"), sections(current_doc, "operations")
    for op in sorted(set(old_ops) | set(new_ops), key=_op_order):
        pairs.append((op, None, _samples(old_ops.get(op)), _samples(new_ops.get(op))))
    old_tests, new_tests = sections(baseline_doc, "tests"), sections(current_doc, "tests")
    for test in sorted(set(old_tests) & set(new_tests)):
        old_test, new_test = old_tests[test], new_tests[test]
        if not isinstance(old_test, Mapping) or not isinstance(new_test, Mapping):
            continue
        for op in sorted(set(old_test) & set(new_test), key=_op_order):
            pairs.append((op, test, _samples(old_test[op]), _samples(new_test[op])))
    rows = [_row(op, test, old, new, thresholds, min_samples) for op, test, old, new in pairs]
    rows = _judge_significance(rows, [(old or [], new or []) for _, _, old, new in pairs], alpha)
    return Comparison(
        rows=rows,
        warnings=warnings,
        baseline_label=baseline_label,
        current_label=current_label,
        delta_stat=thresholds[0].stat if thresholds else "p95",
    )


def compare_with_baseline(
    root: str | os.PathLike[str],
    current_doc: Mapping[str, object],
    thresholds: Sequence[Threshold] = (),
    ref: str | None = None,
    *,
    min_samples: int = DEFAULT_MIN_SAMPLES,
    alpha: float = DEFAULT_ALPHA,
) -> Comparison:
    """Compare ``current_doc`` with the stored run ``ref`` (see :func:`find_baseline`).

    Without a baseline there is nothing to fail on: the result has no rows and
    one warning saying what was looked for and where, for the caller to print.
    """
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
    )
