"""Latency budgets: limits on operation latencies that fail the run when exceeded.

Budgets come from three places, and each :class:`Budget` remembers which so a
violation can tell the user what to edit:

- forkd.yaml, suite-wide, optionally per storage backend::

      budgets:
        fork: {p50_ms: 50, p95_ms: 200, max_ms: 500, backends: {diff: {p95_ms: 40}}}
        branch_pause: {p95_ms: 30}

- the command line, suite-wide: ``OP.STAT=VALUE`` such as ``branch_pause.p95=30``
  or ``fork.max=200ms``;
- the ``forkd_budget(fork_ms=..., exec_ms=...)`` marker, or the
  ``forkd_budget`` fixture called the same way, per test. Such a value bounds
  every sample of that operation in the test, i.e. it is a limit on the test's
  ``max``, and a violation fails that test in its own report.

Exec samples of a test's own workload (``vm.exec(..., timing="workload")``)
are the separate operation ``exec[workload]``: ``exec`` budgets leave them
out; ``exec_workload_ms=`` (marker, fixture) or ``exec[workload]`` (forkd.yaml,
command line) limits them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from pytest_forkd.errors import ConfigError, ConfigProblems, did_you_mean
from pytest_forkd.latency.timings import KNOWN_OPS, Sample

#: Statistics a budget can limit.
BUDGET_STATS: Final = ("p50", "p95", "p99", "max", "mean")


def marker_key(op: str) -> str:
    """The keyword a per-test budget on ``op`` takes: ``fork_ms``, ``exec_workload_ms`` for ``exec[workload]``."""
    return op.replace("[", "_").replace("]", "") + "_ms"


#: Keyword of the marker and fixture -> operation it limits.
MARKER_KEYS: Final = {marker_key(op): op for op in KNOWN_OPS}

#: Registration line for the marker (``config.addinivalue_line("markers", ...)``).
MARKER_HELP: Final = (
    "forkd_budget(" + ", ".join(f"{key}=None" for key in MARKER_KEYS) + "): "
    "fail the test when any sample of that operation in it takes longer than the given milliseconds"
)

_CLI_PATTERN: Final = re.compile(
    r"^\s*(?P<op>[A-Za-z_]+(?:\[[A-Za-z_]+\])?)\.(?P<stat>[A-Za-z0-9]+)"
    r"\s*=\s*(?P<value>[0-9.eE+-]+)\s*(?P<unit>ms|s)?\s*$"
)
_CLI_FORM: Final = "OP.STAT=VALUE[ms|s], e.g. branch_pause.p95=30 or fork.max=200ms"


@dataclass(frozen=True)
class Budget:
    """A limit of ``limit_ms`` on statistic ``stat`` of operation ``op``.

    ``backend`` restricts it to samples of one storage backend, ``test`` to the
    samples of one test (node id); ``source`` says where it was declared.
    """

    op: str
    stat: str
    limit_ms: float
    backend: str | None = None
    test: str | None = None
    source: str = field(kw_only=True)

    @property
    def key(self) -> tuple[str, str, str | None, str | None]:
        """What a budget limits; a higher-precedence budget with the same key replaces it."""
        return (self.op, self.stat, self.backend, self.test)


@dataclass(frozen=True)
class Violation:
    """A budget that the measured samples exceed."""

    budget: Budget
    measured_ms: float
    n: int

    @property
    def scope(self) -> str:
        return self.budget.test or "whole run"

    def __str__(self) -> str:
        budget = self.budget
        backend = f" [{budget.backend}]" if budget.backend else ""
        return (
            f"{self.scope}: {budget.op}{backend} {budget.stat} = {self.measured_ms:.2f} ms "
            f"exceeds budget {_format_ms(budget.limit_ms)} ms "
            f"(n={self.n}; budget from {budget.source})"
        )


def _format_ms(value: float) -> str:
    return f"{value:g}"


def _figure_over(measured: float, limit: float) -> str:
    """``measured`` in three significant digits, or as many more as show that it is over ``limit``."""
    if measured >= 1000:
        text = f"{measured:.0f}"
        return text if float(text) > limit else f"{measured:.3f}"
    for digits in (3, 4, 5, 6):
        text = f"{measured:.{digits}g}"
        if float(text) > limit:
            break
    return text


def _positive_number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ConfigError(f"{where}: expected a positive number, got {value!r}")
    return float(value)


def _check_op(op: object, where: str) -> str:
    if op not in KNOWN_OPS:
        raise ConfigError(
            f"{where}: unknown operation {op!r}; {did_you_mean(op, KNOWN_OPS)}valid operations: {', '.join(KNOWN_OPS)}"
        )
    return str(op)


#: Keys of one operation's limits in forkd.yaml: ``p95_ms`` and the like.
_STAT_KEYS: Final = tuple(f"{stat}_ms" for stat in BUDGET_STATS)


def _budgets_of_mapping(
    limits: Mapping[object, object],
    op: str,
    origin: str,
    path: str,
    backend: str | None,
    problems: ConfigProblems,
    *,
    allow_backends: bool,
) -> list[Budget]:
    """Budgets of one ``{p95_ms: 200, ...}`` mapping found at ``path`` in ``origin``; mistakes go to ``problems``."""
    budgets: list[Budget] = []
    for key, value in limits.items():
        key_path = f"{path}.{key}"
        where = f"{origin}: {key_path}"
        if key == "backends" and allow_backends:
            if not isinstance(value, Mapping):
                problems.add(
                    f"{where}: expected a mapping of backend name to limits, "
                    f"e.g. {{diff: {{p95_ms: 40}}}}, got {value!r}"
                )
                continue
            for backend_name, backend_limits in value.items():
                backend_path = f"{key_path}.{backend_name}"
                if not isinstance(backend_name, str) or not backend_name:
                    problems.add(f"{origin}: {backend_path}: expected a backend name such as 'diff'")
                elif not isinstance(backend_limits, Mapping):
                    problems.add(
                        f"{origin}: {backend_path}: expected a mapping such as {{p95_ms: 40}}, got {backend_limits!r}"
                    )
                else:
                    budgets += _budgets_of_mapping(
                        backend_limits, op, origin, backend_path, backend_name, problems, allow_backends=False
                    )
            continue
        stat = key[: -len("_ms")] if isinstance(key, str) and key.endswith("_ms") else None
        if stat not in BUDGET_STATS:
            valid = (*_STAT_KEYS, "backends") if allow_backends else _STAT_KEYS
            problems.add(f"{where}: unknown key {key!r}; {did_you_mean(key, valid)}valid keys: {', '.join(valid)}")
            continue
        with problems.collect():
            limit = _positive_number(value, where)
            budgets.append(Budget(op, stat, limit, backend=backend, source=f"{origin} {key_path}"))
    return budgets


def budgets_from_config(budgets: object, *, origin: str = "forkd.yaml") -> list[Budget]:
    """Parse the value of forkd.yaml's ``budgets`` key (already loaded with yaml.safe_load).

    Errors name the field path, e.g. ``forkd.yaml: budgets.fork.p95_ms: expected a
    positive number, got 'x'``; ``origin`` is the file name to put in front. Every
    mistake is reported, one line each, in one ConfigError; a misspelt operation or
    key gets the valid one it most likely meant.
    """
    if budgets is None:
        return []
    if not isinstance(budgets, Mapping):
        raise ConfigError(
            f"{origin}: budgets: expected a mapping of operation to limits, "
            f"e.g. {{fork: {{p95_ms: 200}}}}, got {budgets!r}"
        )
    problems = ConfigProblems()
    parsed: list[Budget] = []
    for op, limits in budgets.items():
        path = f"budgets.{op}"
        with problems.collect():
            _check_op(op, f"{origin}: {path}")
            if not isinstance(limits, Mapping):
                raise ConfigError(f"{origin}: {path}: expected a mapping such as {{p95_ms: 200}}, got {limits!r}")
            parsed += _budgets_of_mapping(limits, str(op), origin, path, None, problems, allow_backends=True)
    problems.raise_all()
    return parsed


def budgets_from_cli(texts: Sequence[str], *, option: str = "--forkd-budget") -> list[Budget]:
    """Parse every ``OP.STAT=VALUE`` given; one ConfigError lists every one that is wrong, a line each."""
    problems = ConfigProblems()
    budgets = []
    for text in texts:
        with problems.collect():
            budgets.append(budget_from_cli(text, option=option))
    problems.raise_all()
    return budgets


def budget_from_cli(text: str, *, option: str = "--forkd-budget") -> Budget:
    """Parse ``OP.STAT=VALUE`` (``ms`` or ``s`` suffix allowed, milliseconds by default).

    A misspelt operation and statistic are both reported (one line each), with the valid names they most
    likely meant.
    """
    match = _CLI_PATTERN.match(text)
    if not match:
        raise ConfigError(f"{option} {text!r}: expected {_CLI_FORM}")
    problems = ConfigProblems()
    op = problems.attempt(lambda: _check_op(match["op"], f"{option} {text!r}"), "")
    stat = match["stat"]
    if stat not in BUDGET_STATS:
        problems.add(
            f"{option} {text!r}: unknown statistic {stat!r}; {did_you_mean(stat, BUDGET_STATS)}"
            f"valid statistics: {', '.join(BUDGET_STATS)}"
        )
    problems.raise_all()
    try:
        value = float(match["value"])
    except ValueError:
        raise ConfigError(f"{option} {text!r}: {match['value']!r} is not a number; expected {_CLI_FORM}") from None
    if match["unit"] == "s":
        value *= 1000.0
    limit = _positive_number(value, f"{option} {text!r}")
    return Budget(op, stat, limit, source=f"{option} {text.strip()}")


def budgets_from_marker(
    test: str, args: Sequence[object], kwargs: Mapping[str, object], *, kind: str = "marker"
) -> list[Budget]:
    """Per-test budgets of a ``forkd_budget(OP_ms=...)`` marker (or fixture call, ``kind="fixture"``) on ``test``.

    Each value bounds the test's ``max`` of that operation: every sample must
    fit. A value of None sets no limit, as in the marker's registered signature.
    An unknown keyword is a ConfigError naming it and listing the valid ones.
    """
    where = f"forkd_budget {kind} on {test}"
    if args:
        raise ConfigError(f"{where}: takes keyword arguments only, e.g. forkd_budget(fork_ms=200)")
    if not kwargs:
        raise ConfigError(f"{where}: give at least one limit, e.g. forkd_budget(fork_ms=200)")
    budgets = []
    for key, value in kwargs.items():
        op = MARKER_KEYS.get(key)
        if op is None:
            raise ConfigError(
                f"{where}: unknown argument {key!r}; {did_you_mean(key, MARKER_KEYS)}valid arguments: "
                f"{', '.join(MARKER_KEYS)} (OPERATION_ms, one per timed operation)"
            )
        if value is None:
            continue
        limit = _positive_number(value, f"{where}: {key}")
        budgets.append(Budget(op, "max", limit, test=test, source=f"{kind} on {test}"))
    return budgets


def violation_report(violations: Sequence[Violation]) -> str:
    """What a test that broke its own budgets reports: each operation, its figure and the limit.

    The first line leads with what failed and both figures, e.g.
    ``exec max 31.9 ms > 1 ms budget (forkd_budget, 1 more)``: it is all
    that pytest's short summary (``-rf``) and many CI logs show of a failure,
    and pytest cuts that line to 80 columns when its output is not a terminal
    (as in CI), so the figures come before the marker's name. The lines below
    list every limit exceeded.
    """
    first = violations[0]
    backend = f" [{first.budget.backend}]" if first.budget.backend else ""
    more = f", {len(violations) - 1} more" if len(violations) > 1 else ""
    lines = [
        f"{first.budget.op}{backend} {first.budget.stat} "
        f"{_figure_over(first.measured_ms, first.budget.limit_ms)} ms > {_format_ms(first.budget.limit_ms)} ms "
        f"budget (forkd_budget{more})"
    ]
    for violation in violations:
        budget = violation.budget
        backend = f" [{budget.backend}]" if budget.backend else ""
        lines.append(
            f"  {budget.op}{backend}: {budget.stat} {violation.measured_ms:.3f} ms > budget "
            f"{_format_ms(budget.limit_ms)} ms (n={violation.n}; {marker_key(budget.op)}={_format_ms(budget.limit_ms)}"
            f", {budget.source})"
        )
    return "\n".join(lines)


def resolve(*layers: Iterable[Budget]) -> list[Budget]:
    """Combine budget layers given from lowest to highest precedence.

    A budget in a later layer replaces one with the same operation, statistic,
    backend and test (so ``--forkd-budget fork.p95=300`` overrides forkd.yaml's
    ``fork.p95_ms``); budgets limiting different things all apply.
    """
    combined: dict[tuple[str, str, str | None, str | None], Budget] = {}
    for layer in layers:
        for budget in layer:
            combined.pop(budget.key, None)
            combined[budget.key] = budget
    return list(combined.values())


def check(budgets: Iterable[Budget], samples: Iterable[Sample]) -> list[Violation]:
    """Violations of ``budgets`` by ``samples``, in budget order.

    A suite-wide budget (``test`` None) applies to every sample of its
    operation, a per-test budget only to that test's samples; a ``backend``
    narrows either to samples of that backend. A budget without matching
    samples is not violated.
    """
    from pytest_forkd.latency.stats import summarize  # statistics load when a run is judged, not with pytest

    pool = list(samples)
    violations = []
    for budget in budgets:
        values = [
            sample.ms
            for sample in pool
            if sample.op == budget.op
            and (budget.backend is None or sample.backend == budget.backend)
            and (budget.test is None or sample.test == budget.test)
        ]
        if not values:
            continue
        measured = summarize(values).get(budget.stat)
        if measured > budget.limit_ms:
            violations.append(Violation(budget, measured, len(values)))
    return violations


def describe_budgets(op: str, budgets: Iterable[Budget]) -> str:
    """How ``op`` is limited, for a summary's budget column: suite-wide limits, then the tests' own.

    Per-test budgets (a ``forkd_budget`` marker or fixture) are counted, not
    listed: ``max<=5000 in 3 tests`` (a range when they differ).
    """
    relevant = [budget for budget in budgets if budget.op == op]
    shown = [
        f"{budget.stat}<={budget.limit_ms:g}" + (f"[{budget.backend}]" if budget.backend else "")
        for budget in relevant
        if budget.test is None
    ]
    per_test = [budget for budget in relevant if budget.test is not None]
    if per_test:
        limits = sorted({budget.limit_ms for budget in per_test})
        tests = len({budget.test for budget in per_test})
        bound = f"{limits[0]:g}" if len(limits) == 1 else f"{limits[0]:g}-{limits[-1]:g}"
        shown.append(f"max<={bound} in {tests} test{'' if tests == 1 else 's'}")
    return ", ".join(shown) or "-"
