from __future__ import annotations

import random
import time

import pytest

from pytest_forkd.latency.stats import STAT_NAMES, percentile, slower_p_value, subsample, summarize


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        # numpy.percentile(values, q) with the default 'linear' method
        ([1, 2, 3, 4], 50, 2.5),
        ([1, 2, 3, 4], 95, 3.85),
        ([10, 20, 30, 40, 50], 25, 20.0),
        ([15, 20, 35, 40, 50], 40, 29.0),
        ([7], 99, 7.0),
        ([3, 1, 2], 0, 1.0),
        ([3, 1, 2], 100, 3.0),
    ],
)
def test_percentile_interpolates_linearly_like_numpy(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="between 0 and 100"):
        percentile([1.0], 101)


def test_summarize_reports_all_statistics():
    summary = summarize([float(v) for v in range(1, 101)])
    assert summary.n == 100
    assert (summary.min, summary.max, summary.mean) == (1.0, 100.0, 50.5)
    assert summary.p50 == pytest.approx(50.5)
    assert summary.p95 == pytest.approx(95.05)
    assert summary.p99 == pytest.approx(99.01)
    assert [summary.get(stat) for stat in STAT_NAMES] == [1.0, 50.5, 95.05, 99.01, 100.0, 50.5]


def test_summary_to_dict_rounds_to_microseconds():
    data = summarize([1.23456789, 2.0]).to_dict()
    assert set(data) == {"n", "min", "p50", "p95", "p99", "max", "mean"}
    assert data["n"] == 2
    assert data["min"] == 1.235
    assert data["mean"] == 1.617


def test_summarize_and_get_reject_bad_input():
    with pytest.raises(ValueError, match="zero samples"):
        summarize([])
    with pytest.raises(ValueError, match="unknown statistic 'p90'"):
        summarize([1.0]).get("p90")


def test_subsample_keeps_extremes_and_is_order_independent():
    values = [float(v) for v in range(10_000)]
    shuffled = values[:]
    random.Random(3).shuffle(shuffled)
    picked = subsample(shuffled, 101)
    assert len(picked) == 101
    assert picked == subsample(values, 101)
    assert (picked[0], picked[-1]) == (0.0, 9999.0)
    assert picked[50] == pytest.approx(percentile(values, 50), abs=1)
    assert subsample([3.0, 1.0], 10) == [1.0, 3.0]


def _lognormal(seed: int, n: int, scale: float = 1.0) -> list[float]:
    rng = random.Random(seed)
    return [scale * rng.lognormvariate(4.0, 0.4) for _ in range(n)]


def test_identical_samples_are_not_slower():
    values = _lognormal(1, 200)
    for stat in STAT_NAMES:
        assert slower_p_value(values, values, stat) == 1.0


def test_faster_samples_are_not_slower():
    assert slower_p_value(_lognormal(1, 100, 2.0), _lognormal(2, 100), "p50") == 1.0


def test_a_doubled_distribution_is_significantly_slower():
    baseline, current = _lognormal(1, 60), _lognormal(2, 60, 2.0)
    for stat in ("p50", "p95", "mean", "max"):
        assert slower_p_value(baseline, current, stat) < 0.01


def test_two_draws_of_one_distribution_are_not_significantly_different():
    assert slower_p_value(_lognormal(1, 200), _lognormal(2, 200), "p95") > 0.05


def test_p_value_is_deterministic_and_independent_of_sample_order():
    baseline, current = _lognormal(5, 80), _lognormal(6, 80, 1.1)
    first = slower_p_value(baseline, current, "p50")
    assert 0 < first < 1
    assert slower_p_value(list(reversed(baseline)), current[::-1], "p50") == first


def test_early_stop_keeps_the_verdict():
    baseline, current = _lognormal(1, 200), _lognormal(2, 200, 1.01)
    full = slower_p_value(baseline, current, "p50")
    early = slower_p_value(baseline, current, "p50", stop_above=0.05)
    assert (full < 0.05) == (early < 0.05)
    assert early > 0.05


@pytest.mark.slow  # large samples
def test_large_inputs_stay_fast_through_subsampling():
    baseline, current = _lognormal(1, 50_000), _lognormal(2, 50_000, 1.5)
    started = time.perf_counter()
    assert slower_p_value(baseline, current, "p95") < 0.01
    assert time.perf_counter() - started < 10.0
