from __future__ import annotations

import pytest
import yaml

from pytest_forkd.errors import ConfigError
from pytest_forkd.latency import timings
from pytest_forkd.latency.budgets import (
    MARKER_HELP,
    Budget,
    budget_from_cli,
    budgets_from_cli,
    budgets_from_config,
    budgets_from_marker,
    check,
    resolve,
)
from pytest_forkd.latency.timings import Sample

FORKD_YAML = """
budgets:
  fork:
    p50_ms: 50
    p95_ms: 200
    max_ms: 500.5
    backends:
      diff: {p95_ms: 40}
  branch_pause: {p95_ms: 30}
"""


def test_budgets_from_config_reads_suite_and_backend_limits():
    budgets = budgets_from_config(yaml.safe_load(FORKD_YAML)["budgets"])
    assert [(b.op, b.stat, b.limit_ms, b.backend) for b in budgets] == [
        ("fork", "p50", 50.0, None),
        ("fork", "p95", 200.0, None),
        ("fork", "max", 500.5, None),
        ("fork", "p95", 40.0, "diff"),
        ("branch_pause", "p95", 30.0, None),
    ]
    assert budgets[1].source == "forkd.yaml budgets.fork.p95_ms"
    assert budgets[3].source == "forkd.yaml budgets.fork.backends.diff.p95_ms"
    assert all(b.test is None for b in budgets)


def test_budgets_from_config_accepts_no_budgets():
    assert budgets_from_config(None) == []
    assert budgets_from_config({}) == []


@pytest.mark.parametrize(
    ("budgets", "message"),
    [
        ({"fork": {"p95_ms": "x"}}, "forkd.yaml: budgets.fork.p95_ms: expected a positive number, got 'x'"),
        ({"fork": {"p95_ms": 0}}, "forkd.yaml: budgets.fork.p95_ms: expected a positive number, got 0"),
        ({"fork": {"p95_ms": -3}}, "budgets.fork.p95_ms: expected a positive number, got -3"),
        ({"fork": {"p95_ms": True}}, "budgets.fork.p95_ms: expected a positive number, got True"),
        ({"fork": {"p95_ms": None}}, "budgets.fork.p95_ms: expected a positive number, got None"),
        (
            {"fork": {"p90_ms": 5}},
            "budgets.fork.p90_ms: unknown key 'p90_ms'; did you mean 'p99_ms'? "
            "valid keys: p50_ms, p95_ms, p99_ms, max_ms, mean_ms, backends",
        ),
        (
            {"forks": {"p95_ms": 5}},
            "budgets.forks: unknown operation 'forks'; did you mean 'fork'? valid operations: fork, branch_pause,",
        ),
        ({"fork": 200}, "budgets.fork: expected a mapping such as {p95_ms: 200}, got 200"),
        ({"fork": {"backends": ["diff"]}}, "budgets.fork.backends: expected a mapping of backend name to limits"),
        ({"fork": {"backends": {"diff": 40}}}, "budgets.fork.backends.diff: expected a mapping such as {p95_ms: 40}"),
        (
            {"fork": {"backends": {"diff": {"p95_ms": "fast"}}}},
            "budgets.fork.backends.diff.p95_ms: expected a positive number",
        ),
        (["fork"], "forkd.yaml: budgets: expected a mapping of operation to limits"),
    ],
)
def test_budgets_from_config_errors_name_the_field_path(budgets, message):
    with pytest.raises(ConfigError) as excinfo:
        budgets_from_config(budgets)
    assert message in str(excinfo.value)


def test_backend_limits_cannot_nest_backends():
    with pytest.raises(ConfigError) as excinfo:
        budgets_from_config({"fork": {"backends": {"diff": {"backends": {}}}}})
    assert str(excinfo.value) == (
        "forkd.yaml: budgets.fork.backends.diff.backends: unknown key 'backends'; "
        "valid keys: p50_ms, p95_ms, p99_ms, max_ms, mean_ms"
    )


def test_budgets_from_config_puts_the_origin_in_errors_and_sources():
    with pytest.raises(ConfigError, match=r"^ci/forkd.yaml: budgets.exec.max_ms"):
        budgets_from_config({"exec": {"max_ms": "slow"}}, origin="ci/forkd.yaml")
    (budget,) = budgets_from_config({"exec": {"max_ms": 9}}, origin="ci/forkd.yaml")
    assert budget.source == "ci/forkd.yaml budgets.exec.max_ms"


@pytest.mark.parametrize(
    ("text", "op", "stat", "limit"),
    [
        ("branch_pause.p95=30", "branch_pause", "p95", 30.0),
        ("fork.max=200ms", "fork", "max", 200.0),
        (" exec.mean = 0.5 ms ", "exec", "mean", 0.5),
        ("restore.p99=1.5s", "restore", "p99", 1500.0),
    ],
)
def test_budget_from_cli(text, op, stat, limit):
    budget = budget_from_cli(text)
    assert (budget.op, budget.stat, budget.limit_ms, budget.backend, budget.test) == (op, stat, limit, None, None)
    assert budget.source == f"--forkd-budget {text.strip()}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fork=200", "expected OP.STAT=VALUE[ms|s], e.g. branch_pause.p95=30 or fork.max=200ms"),
        ("fork.p95:200", "expected OP.STAT=VALUE"),
        ("fork.p95=fast", "expected OP.STAT=VALUE"),
        ("fork.p95=200us", "expected OP.STAT=VALUE"),
        ("fork.p95=1.2.3", "'1.2.3' is not a number"),
        ("fork.p95=0", "expected a positive number, got 0.0"),
        ("fork.min=5", "unknown statistic 'min'; valid statistics: p50, p95, p99, max, mean"),
        ("spawn.p95=5", "unknown operation 'spawn'; valid operations: fork,"),
    ],
)
def test_budget_from_cli_rejects_malformed_values(text, message):
    with pytest.raises(ConfigError) as excinfo:
        budget_from_cli(text)
    assert str(excinfo.value).startswith(f"--forkd-budget {text!r}: ")
    assert message in str(excinfo.value)


def test_budgets_from_marker_bound_the_max_of_each_operation_in_the_test():
    budgets = budgets_from_marker("tests/t.py::test_y", (), {"fork_ms": 300, "exec_ms": None, "branch_pause_ms": 25.5})
    assert budgets == [
        Budget("fork", "max", 300.0, test="tests/t.py::test_y", source="marker on tests/t.py::test_y"),
        Budget("branch_pause", "max", 25.5, test="tests/t.py::test_y", source="marker on tests/t.py::test_y"),
    ]


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((300,), {}, "takes keyword arguments only"),
        ((), {}, "give at least one limit"),
        (
            (),
            {"fork": 300},
            "unknown argument 'fork'; did you mean 'fork_ms'? valid arguments: fork_ms, branch_pause_ms,",
        ),
        ((), {"fork_ms": "300ms"}, "fork_ms: expected a positive number, got '300ms'"),
    ],
)
def test_budgets_from_marker_rejects_malformed_markers(args, kwargs, message):
    with pytest.raises(ConfigError) as excinfo:
        budgets_from_marker("t.py::test_z", args, kwargs)
    assert str(excinfo.value).startswith("forkd_budget marker on t.py::test_z: ")
    assert message in str(excinfo.value)


def test_marker_help_lists_every_keyword():
    assert MARKER_HELP.startswith("forkd_budget(fork_ms=None, branch_pause_ms=None,")


def test_resolve_lets_later_layers_override_the_same_limit():
    from_yaml = budgets_from_config({"fork": {"p95_ms": 200, "max_ms": 500}})
    from_cli = [budget_from_cli("fork.p95=300")]
    resolved = resolve(from_yaml, from_cli)
    assert sorted((b.stat, b.limit_ms, b.source) for b in resolved) == [
        ("max", 500.0, "forkd.yaml budgets.fork.max_ms"),
        ("p95", 300.0, "--forkd-budget fork.p95=300"),
    ]


def _samples(op, values, **fields):
    return [Sample(op=op, ms=float(v), **fields) for v in values]


def test_check_suite_budget_uses_the_statistic_over_all_samples():
    samples = _samples("fork", range(1, 101)) + _samples("exec", [1000])
    assert check([Budget("fork", "p95", 96.0, source="s")], samples) == []
    (violation,) = check([Budget("fork", "p95", 95.0, source="forkd.yaml budgets.fork.p95_ms")], samples)
    assert violation.measured_ms == pytest.approx(95.05)
    assert violation.n == 100
    assert str(violation) == (
        "whole run: fork p95 = 95.05 ms exceeds budget 95 ms (n=100; budget from forkd.yaml budgets.fork.p95_ms)"
    )


def test_check_backend_budget_only_sees_that_backend():
    samples = _samples("branch_pause", [100, 120], backend="full") + _samples("branch_pause", [10, 12], backend="diff")
    budgets = [Budget("branch_pause", "max", 40, backend="diff", source="yaml")]
    assert check(budgets, samples) == []
    samples += _samples("branch_pause", [41], backend="diff")
    (violation,) = check(budgets, samples)
    assert "branch_pause [diff] max = 41.00 ms" in str(violation)


def test_check_per_test_budget_only_sees_that_test():
    samples = _samples("fork", [500], test="t::slow_allowed") + _samples("fork", [90, 120], test="t::fast")
    marker = budgets_from_marker("t::fast", (), {"fork_ms": 100})
    (violation,) = check(marker, samples)
    assert violation.scope == "t::fast"
    assert violation.measured_ms == 120.0
    assert str(violation) == "t::fast: fork max = 120.00 ms exceeds budget 100 ms (n=2; budget from marker on t::fast)"


def test_check_ignores_budgets_without_samples():
    assert check([Budget("restore", "p50", 1, source="cli")], _samples("fork", [1000])) == []


def test_every_budget_mistake_of_forkd_yaml_is_reported_in_one_error():
    with pytest.raises(ConfigError) as excinfo:
        budgets_from_config(
            {"frok": {"p95_ms": 1}, "fork": {"p95": 5, "max_ms": "x", "backends": {"diff": {"p59_ms": 2}}}}
        )
    lines = str(excinfo.value).splitlines()
    assert [line.split(": ")[1] for line in lines] == [
        "budgets.frok",
        "budgets.fork.p95",
        "budgets.fork.max_ms",
        "budgets.fork.backends.diff.p59_ms",
    ]
    assert "did you mean 'fork'?" in lines[0] and "did you mean 'p95_ms'?" in lines[1]
    assert lines[3].endswith("valid keys: p50_ms, p95_ms, p99_ms, max_ms, mean_ms")  # no backends under a backend


def test_a_misspelt_operation_and_statistic_on_the_command_line_are_both_named():
    with pytest.raises(ConfigError) as excinfo:
        budget_from_cli("frok.p59=30")
    lines = str(excinfo.value).splitlines()
    assert lines == [
        "--forkd-budget 'frok.p59=30': unknown operation 'frok'; did you mean 'fork'? valid operations: "
        + ", ".join(timings.KNOWN_OPS),
        "--forkd-budget 'frok.p59=30': unknown statistic 'p59'; did you mean 'p99'? "
        "valid statistics: p50, p95, p99, max, mean",
    ]


def test_every_bad_command_line_budget_is_reported_together():
    assert [b.key for b in budgets_from_cli(["fork.p95=300", "exec.max=1s"])] == [
        ("fork", "p95", None, None),
        ("exec", "max", None, None),
    ]
    with pytest.raises(ConfigError) as excinfo:
        budgets_from_cli(["fork.p95=300", "fork.p95", "exec.mx=5"])
    lines = str(excinfo.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("--forkd-budget 'fork.p95': expected OP.STAT=VALUE")
    assert lines[1].startswith("--forkd-budget 'exec.mx=5': unknown statistic 'mx'; did you mean 'max'?")
