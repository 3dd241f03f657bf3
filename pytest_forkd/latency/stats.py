"""Latency statistics without numpy: summaries and a noise-aware slowdown test.

Latency distributions of VM operations are skewed and noisy (TCG, shared CI
machines), so reports give percentiles rather than a mean alone, and a
comparison only calls something a regression when a permutation test says the
new samples really are slower, not just unlucky.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from itertools import compress
from statistics import fmean
from typing import Final

#: Statistic names a :class:`Summary` provides, in report order.
STAT_NAMES: Final = ("min", "p50", "p95", "p99", "max", "mean")

#: Seed of the permutation test: the same inputs always give the same verdict.
PERMUTATION_SEED: Final = 20240607

_DECIMALS: Final = 3  # microsecond resolution for millisecond values
_FLIP_MASK: Final = bytes.maketrans(b"\x00\x01", b"\x01\x00")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation, like numpy's default."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be between 0 and 100, got {q}")
    return _percentile_of_sorted(sorted(values), q)


def _percentile_of_sorted(ordered: Sequence[float], q: float) -> float:
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _statistic_of_sorted(stat: str) -> Callable[[Sequence[float]], float]:
    """A function computing ``stat`` from an already sorted, non-empty sequence."""
    if stat == "min":
        return lambda ordered: ordered[0]
    if stat == "max":
        return lambda ordered: ordered[-1]
    if stat == "mean":
        return fmean
    if stat in ("p50", "p95", "p99"):
        q = float(stat[1:])
        return lambda ordered: _percentile_of_sorted(ordered, q)
    raise ValueError(f"unknown statistic {stat!r}; use one of {', '.join(STAT_NAMES)}")


@dataclass(frozen=True)
class Summary:
    """Distribution of one set of latencies in milliseconds."""

    n: int
    min: float
    p50: float
    p95: float
    p99: float
    max: float
    mean: float

    def get(self, stat: str) -> float:
        """The value of statistic ``stat`` (one of :data:`STAT_NAMES`)."""
        if stat not in STAT_NAMES:
            raise ValueError(f"unknown statistic {stat!r}; use one of {', '.join(STAT_NAMES)}")
        return float(getattr(self, stat))

    def to_dict(self) -> dict[str, float]:
        """JSON form; values rounded to the microsecond, which is below any timer noise."""
        return {key: (value if key == "n" else round(value, _DECIMALS)) for key, value in asdict(self).items()}


def summarize(values: Sequence[float]) -> Summary:
    """Summarise latencies; raises ValueError for an empty sequence."""
    if not values:
        raise ValueError("cannot summarise zero samples")
    ordered = sorted(float(v) for v in values)
    return Summary(
        n=len(ordered),
        min=ordered[0],
        p50=_percentile_of_sorted(ordered, 50),
        p95=_percentile_of_sorted(ordered, 95),
        p99=_percentile_of_sorted(ordered, 99),
        max=ordered[-1],
        mean=fmean(ordered),
    )


def subsample(values: Sequence[float], cap: int) -> list[float]:
    """At most ``cap`` values, deterministically: evenly spaced order statistics.

    Taking every k-th value of the sorted list keeps the shape of the
    distribution (its min, max and quantiles), unlike a random draw, and makes
    the result independent of the order the samples were recorded in.
    """
    ordered = sorted(values)
    if len(ordered) <= cap:
        return ordered
    if cap < 2:
        raise ValueError(f"cap must be at least 2, got {cap}")
    step = (len(ordered) - 1) / (cap - 1)
    return [ordered[round(i * step)] for i in range(cap)]


def slower_p_value(
    baseline: Sequence[float],
    current: Sequence[float],
    stat: str,
    *,
    stop_above: float | None = None,
    resamples: int = 1000,
    max_samples: int = 1000,
    seed: int = PERMUTATION_SEED,
) -> float:
    """One-sided permutation test: how likely is ``current``'s ``stat`` this much
    above ``baseline``'s if both came from the same distribution?

    Returns the p-value ``(hits + 1) / (resamples + 1)``, where a hit is a
    random relabelling of the pooled samples whose difference in ``stat`` is
    at least the observed one; 1.0 when ``current`` is not slower at all.
    Deterministic (fixed ``seed``) and bounded in cost: each side is cut to
    ``max_samples`` by :func:`subsample`, and when ``stop_above`` is given the
    test stops as soon as the p-value is certain to end above it (the returned
    estimate is then above it too): callers deciding at a significance level
    need no more precision than that.
    """
    if not baseline or not current:
        raise ValueError("the permutation test needs samples on both sides")
    compute = _statistic_of_sorted(stat)
    old = subsample(baseline, max_samples)
    new = subsample(current, max_samples)
    observed = compute(new) - compute(old)
    tolerance = 1e-9 * max(abs(compute(old)), abs(compute(new)), 1.0)
    if observed <= tolerance:
        return 1.0

    # Pooled values stay sorted; a random mask picks the relabelled "current"
    # side, and itertools.compress yields both sides already sorted.
    pooled = sorted(old + new)
    indices = range(len(pooled))
    rng = random.Random(seed)
    max_hits = math.inf if stop_above is None else stop_above * (resamples + 1) - 1
    hits = 0
    for done in range(1, resamples + 1):
        mask = bytearray(len(pooled))
        for index in rng.sample(indices, len(new)):
            mask[index] = 1
        relabelled_new = list(compress(pooled, mask))
        relabelled_old = list(compress(pooled, mask.translate(_FLIP_MASK)))
        if compute(relabelled_new) - compute(relabelled_old) >= observed - tolerance:
            hits += 1
            if hits > max_hits:
                return (hits + 1) / (done + 1)
    return (hits + 1) / (resamples + 1)


#: A change of at least this many times the measured noise is always flagged:
#: with enough samples such a change is not chance, whatever a permutation test
#: at a level corrected for hundreds of checks can resolve from a few samples.
NOISE_FACTOR: Final = 4.0

#: Samples each run needs before its noise is trusted: with fewer, a tight run
#: on a machine that got busier between runs looks like a many-fold change.
NOISE_MIN_SAMPLES: Final = 10

#: The noise of a statistic is never taken as less than 1% (relative): identical
#: samples do not make a 0.1% change "infinitely many times the noise".
NOISE_FLOOR: Final = 0.01


#: Standard error of a percentile of normal data, in standard deviations times
#: the square root of n: sqrt(q (1 - q)) / density at the q-th quantile.
_NORMAL_QUANTILE_SE: Final = {"p50": 1.2533, "p95": 2.1114, "p99": 3.7316}


def statistic_noise(values: Sequence[float], stat: str) -> float:
    """Relative standard error of ``stat`` of the latencies ``values`` (on a log scale: 0.1 is ~10%),
    estimated from the samples themselves.

    Latencies vary multiplicatively, hence the log scale. A percentile's noise
    is the larger of two estimates: the standard error it would have if the
    latencies were log-normal (stable with few samples), and half the spread
    of the order statistics within one binomial standard deviation of its rank
    (honest about heavy or lumpy tails). The mean's is its standard error, on
    the log scale or relative to the mean, whichever is larger; min and max
    never settle as samples grow, so theirs is the spread of the samples.
    Needs at least 2 positive values.
    """
    if len(values) < 2:
        raise ValueError("the noise of a statistic needs at least 2 samples")
    if min(values) <= 0:
        raise ValueError("latencies must be positive to measure their relative noise")
    logs = sorted(math.log(v) for v in values)
    n = len(logs)
    spread = _stdev(logs)
    if stat in ("min", "max"):
        return spread
    if stat == "mean":
        return max(spread, _stdev(values) / fmean(values)) / math.sqrt(n)
    if stat not in _NORMAL_QUANTILE_SE:
        raise ValueError(f"unknown statistic {stat!r}; use one of {', '.join(STAT_NAMES)}")
    q = float(stat[1:]) / 100.0
    position = (n - 1) * q
    ranks = max(math.sqrt(n * q * (1 - q)), 1.0)
    low = max(0, math.floor(position - ranks))
    high = min(n - 1, math.ceil(position + ranks))
    return max(_NORMAL_QUANTILE_SE[stat] * spread / math.sqrt(n), (logs[high] - logs[low]) / 2.0)


def _stdev(values: Sequence[float]) -> float:
    mean = fmean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def noise_multiple(baseline: Sequence[float], current: Sequence[float], stat: str) -> float:
    """How many times the measured noise ``current``'s ``stat`` lies above ``baseline``'s (negative: below).

    The change is taken on a log scale (``ln(new / old)``: +425% is 1.66) and
    divided by the noise of both runs' statistic combined (root of the sum of
    squares of :func:`statistic_noise`), at least :data:`NOISE_FLOOR`. Zero
    when a run has fewer than :data:`NOISE_MIN_SAMPLES` samples or a value
    that is not positive: too little to measure the noise by.
    """
    if min(len(baseline), len(current)) < NOISE_MIN_SAMPLES or min(baseline) <= 0 or min(current) <= 0:
        return 0.0
    compute = _statistic_of_sorted(stat)
    change = math.log(compute(sorted(current)) / compute(sorted(baseline)))
    noise = math.hypot(statistic_noise(baseline, stat), statistic_noise(current, stat))
    return change / max(noise, NOISE_FLOOR)
