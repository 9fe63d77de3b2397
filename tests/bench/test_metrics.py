"""Metrics math on hand-built timings: exact values, vLLM's definitions."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import SLO, RequestRecord, summarize


def _records() -> list[RequestRecord]:
    # Binary-exact times (multiples of 1/64 s) so every expected value below is exact.
    return [
        RequestRecord(0, 10, 4, success=True, ttft=0.125, itl=[0.0625, 0.03125, 0.03125], e2e=0.25, output_tokens=4),
        RequestRecord(1, 20, 4, success=True, ttft=0.5, itl=[0.25], e2e=0.75, output_tokens=2),
        RequestRecord(2, 30, 4, success=True, ttft=0.0625, itl=[], e2e=0.0625, output_tokens=1),
        RequestRecord(3, 40, 4, success=False, error="HTTP 503: busy"),
    ]


def test_tpot_is_decode_time_over_tokens_after_the_first():
    r0, r1, r2, r3 = _records()
    assert r0.tpot == (0.25 - 0.125) / 3
    assert r1.tpot == 0.25
    assert r2.tpot is None  # one token: no decode interval
    assert r3.tpot is None  # failed


def test_token_times_are_send_plus_ttft_plus_cumulative_itl():
    r = RequestRecord(0, 1, 3, send_time=2.0, success=True, ttft=0.5, itl=[0.25, 0.125], e2e=0.875, output_tokens=3)
    assert r.token_times().tolist() == [2.5, 2.75, 2.875]
    assert RequestRecord(1, 1, 1).token_times().size == 0


def test_summary_exact_values():
    s = summarize(_records(), duration_s=2.0, slo=SLO(ttft_ms=200, tpot_ms=50))
    assert (s["num_prompts"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["total_input_tokens"] == 60  # the failed request's prompt does not count
    assert s["total_output_tokens"] == 7
    assert s["request_throughput"] == 1.5
    assert s["output_throughput"] == 3.5
    assert s["total_token_throughput"] == 33.5
    # TTFT ms [125, 500, 62.5]; numpy linear percentiles over the sorted [62.5, 125, 500].
    assert s["mean_ttft_ms"] == pytest.approx(687.5 / 3)
    assert s["median_ttft_ms"] == s["p50_ttft_ms"] == 125.0
    assert s["p90_ttft_ms"] == pytest.approx(125 + 0.8 * 375)
    assert s["p99_ttft_ms"] == pytest.approx(125 + 0.98 * 375)
    # TPOT only where output_tokens > 1: [41.666.., 250].
    assert s["mean_tpot_ms"] == pytest.approx((125 / 3 + 250) / 2)
    # ITL is the flat list of every gap: [62.5, 31.25, 31.25, 250] ms.
    assert s["mean_itl_ms"] == pytest.approx(93.75)
    assert s["median_itl_ms"] == pytest.approx(46.875)
    assert s["p99_itl_ms"] == pytest.approx(62.5 + 0.97 * 187.5)
    assert s["mean_e2el_ms"] == pytest.approx(1062.5 / 3)
    # Good: r0 (ttft 125 <= 200, tpot 41.7 <= 50) and r2 (one token: tpot counts as 0).
    # r1 misses TTFT; r3 failed. goodput = 2 / 2 s; attainment = 2 of all 4.
    assert s["good_requests"] == 2
    assert s["request_goodput"] == 1.0
    assert s["slo_attainment"] == 0.5


def test_slo_bounds_are_inclusive_and_each_key_counts():
    r = RequestRecord(0, 1, 3, success=True, ttft=0.25, itl=[0.125, 0.125], e2e=0.5, output_tokens=3)
    assert SLO(ttft_ms=250, tpot_ms=125, e2el_ms=500).is_met(r)
    assert not SLO(ttft_ms=249).is_met(r)
    assert not SLO(tpot_ms=124).is_met(r)
    assert not SLO(e2el_ms=499).is_met(r)
    assert SLO(ttft_ms=1000).is_met(r)


def test_no_slo_gives_no_goodput():
    s = summarize(_records(), duration_s=1.0)
    assert s["request_goodput"] is None and s["slo_attainment"] is None


def test_all_failed_gives_zero_latencies():
    s = summarize([RequestRecord(0, 5, 5, error="x")], duration_s=1.0, slo=SLO(ttft_ms=1))
    assert s["completed"] == 0 and s["mean_ttft_ms"] == 0.0 and s["p99_itl_ms"] == 0.0
    assert s["request_goodput"] == 0.0 and s["slo_attainment"] == 0.0


def test_slo_parse():
    assert SLO.parse(["ttft:10000", "tpot:150"]) == SLO(ttft_ms=10000.0, tpot_ms=150.0)
    assert SLO.parse(["e2el:5.5"]) == SLO(e2el_ms=5.5)
    assert SLO.parse(None) is None and SLO.parse([]) is None
    assert SLO(ttft_ms=1.0).to_dict() == {"ttft_ms": 1.0}


@pytest.mark.parametrize("items, fragment", [
    (["ttft=10"], "KEY:MILLISECONDS"),
    (["itl:10"], "ttft, tpot, e2el"),
    (["ttft:fast"], "not a number"),
    (["ttft:0"], "positive"),
    (["tpot:1", "tpot:2"], "twice"),
])
def test_slo_parse_errors_name_the_item(items, fragment):
    with pytest.raises(ValueError, match=fragment):
        SLO.parse(items)


def test_summarize_rejects_zero_duration():
    with pytest.raises(ValueError, match="duration"):
        summarize(_records(), duration_s=0.0)


def test_record_round_trips_through_dict():
    r = _records()[0]
    assert RequestRecord.from_dict(r.to_dict()) == r
