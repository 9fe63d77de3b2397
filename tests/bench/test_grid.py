"""`pdserve bench grid`: goodput at every SLO pair and DistServe's SLO scale, from per-request records
(the live path, from a real sweep's run files, is in test_sweep.py)."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.grid import build_grid, slo_scale
from pdserve.bench.metrics import SLO, RequestRecord


def _rec(ttft_s: float, tpot_s: float, tokens: int = 5, ok: bool = True) -> RequestRecord:
    return RequestRecord(0, 10, tokens, success=ok, ttft=ttft_s, itl=[tpot_s] * (tokens - 1),
                         e2e=ttft_s + tpot_s * (tokens - 1), output_tokens=tokens)


def test_slo_scale_is_the_need_of_the_request_at_the_attainment_quantile():
    ref = SLO(ttft_ms=1000, tpot_ms=100)
    # needs: max(ttft / 1 s, tpot / 0.1 s) = 0.5, 2, 3, and a failed request needs infinity
    records = [_rec(0.5, 0.05), _rec(2.0, 0.01), _rec(0.1, 0.3), _rec(0, 0, ok=False)]
    assert slo_scale(records, ref, 0.25) == pytest.approx(0.5)
    assert slo_scale(records, ref, 0.5) == pytest.approx(2.0)
    assert slo_scale(records, ref, 0.75) == pytest.approx(3.0)
    assert math.isinf(slo_scale(records, ref, 0.9))  # 4 of 4 needed: the failed one never meets any
    assert math.isinf(slo_scale([], ref, 0.9))


def test_each_cell_is_the_strict_goodput_under_that_slo_pair():
    fast_decode = {0.1: [_rec(2.0, 0.03)] * 10, 0.2: [_rec(4.0, 0.03)] * 10, 0.3: [_rec(9.0, 0.03)] * 10}
    fast_prefill = {0.1: [_rec(1.0, 0.09)] * 10, 0.2: [_rec(1.2, 0.2)] * 10, 0.3: [_rec(1.0, 0.09)] * 10}
    runs = {"disagg": sorted(fast_decode.items()), "agg": sorted(fast_prefill.items())}
    grid = build_grid(runs, [2500, 10000], [50, 100], SLO(ttft_ms=10000, tpot_ms=150), 0.9)
    cells = {(c["ttft_ms"], c["tpot_ms"]): c["goodput"] for c in grid["cells"]}
    assert cells[2500, 50] == {"disagg": 0.1, "agg": 0.0}
    assert cells[10000, 50] == {"disagg": 0.3, "agg": 0.0}
    # agg misses TPOT 100 at 0.2 req/s and meets it again at 0.3: 0.3 does not count after the miss
    assert cells[2500, 100] == {"disagg": 0.1, "agg": 0.1}
    assert cells[10000, 100] == {"disagg": 0.3, "agg": 0.1}
    scale = {s: [r["slo_scale"] for r in grid["slo_scale"][s]] for s in grid["systems"]}
    assert scale == {"disagg": [0.2, 0.4, 0.9], "agg": [0.6, 1.333, 0.6]}
