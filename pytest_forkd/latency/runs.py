"""Stored benchmark runs: where they live, what one records, reading and writing them.

The layout follows pytest-benchmark, so people find their way around:
``<root>/.forkd/benchmarks/<machine_id>/NNNN_<name>.json`` where ``NNNN``
counts up per folder and ``name`` defaults to the short commit id. Runs are
only comparable on the same kind of machine, hence one folder per machine id.
A run records the machine, the commit, the conditions (accelerator,
backend...) and every sample per operation, whole-run and per test;
:mod:`pytest_forkd.latency.compare` compares two of them.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Final

from filelock import FileLock

from pytest_forkd.errors import ConfigError
from pytest_forkd.latency.stats import summarize
from pytest_forkd.latency.timings import KNOWN_OPS, Recorder, Sample
from pytest_forkd.paths import validate_tag

FORMAT_VERSION: Final = 1
_RUN_FILE: Final = re.compile(r"^(?P<counter>\d{4,})_(?P<name>.+)\.json$")


# --- where runs live -------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def machine_id() -> str:
    """pytest-benchmark's machine id, e.g. ``Linux-CPython-3.11-64bit``: stable per machine kind.

    Worked out once per process: ``platform.architecture`` runs ``file`` on the interpreter.
    """
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


def summary_section(values: Sequence[float]) -> dict[str, object]:
    return {"summary": summarize(values).to_dict(), "samples": [round(v, 6) for v in values]}


def build_run(
    samples: Recorder | Iterable[Sample],
    *,
    root: str | os.PathLike[str] | None = None,
    conditions: Mapping[str, object] | None = None,
    qemu_version: str | None = None,
    snapshots: Mapping[str, str | None] | None = None,
) -> dict[str, object]:
    """The JSON document of a run: machine, commit (from the checkout at ``root``),
    free-form ``conditions`` (accel, backend...), and per-operation and per-test
    summaries with their raw samples. ``snapshots`` maps the named snapshots the
    run used to their recipe hashes, so shards that ran different builds are
    not merged (see :mod:`pytest_forkd.latency.shards`).
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
            "snapshots": dict(snapshots or {}),
            "operations": {op: summary_section(values) for op, values in in_report_order(by_op)},
            "tests": {
                test: {op: summary_section(values) for op, values in in_report_order(ops)}
                for test, ops in sorted(by_test.items())
            },
            "samples": [sample.to_dict() for sample in all_samples],
        }
    )
    return document


def op_order(op: str) -> tuple[int, str]:
    return (KNOWN_OPS.index(op) if op in KNOWN_OPS else len(KNOWN_OPS), op)


def in_report_order(groups: Mapping[str, list[float]]) -> list[tuple[str, list[float]]]:
    return sorted(groups.items(), key=lambda item: op_order(item[0]))


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
        document: dict[str, object] = json.loads(text)
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
