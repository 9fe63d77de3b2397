"""Arrival process: seeded, Poisson at the asked mean rate, all-at-once for inf."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets, parse_rate


def test_seeded_and_starts_at_zero():
    a = arrival_offsets(100, 0.5, seed=7)
    assert np.array_equal(a, arrival_offsets(100, 0.5, seed=7))
    assert not np.array_equal(a, arrival_offsets(100, 0.5, seed=8))
    assert a[0] == 0.0 and a.shape == (100,) and np.all(np.diff(a) >= 0)


def test_poisson_mean_rate_and_exponential_gaps():
    rate = 2.0
    gaps = np.diff(arrival_offsets(40_001, rate, seed=1))
    # 40k exponential gaps: the mean is within ~1.5% (3 sigma) of 1/rate, the CV is 1.
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.015)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)
    # Exponential: P(gap > mean) = e^-1.
    assert (gaps > 1 / rate).mean() == pytest.approx(math.exp(-1), abs=0.01)


def test_burstiness_keeps_the_rate_and_changes_the_spread():
    gaps = np.diff(arrival_offsets(40_001, 1.0, seed=2, burstiness=4.0))
    assert gaps.mean() == pytest.approx(1.0, rel=0.015)
    assert gaps.std() / gaps.mean() == pytest.approx(0.5, rel=0.03)  # gamma shape k: CV = 1/sqrt(k)


def test_inf_rate_releases_everything_at_once():
    assert arrival_offsets(5, math.inf).tolist() == [0.0] * 5
    assert arrival_offsets(0, 1.0).size == 0


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_bad_rate(rate):
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(3, rate)


def test_parse_rate():
    assert parse_rate("0.1") == 0.1 and parse_rate("inf") == math.inf
    for bad in ("fast", "0", "-2"):
        with pytest.raises(ValueError, match="--request-rate"):
            parse_rate(bad)
