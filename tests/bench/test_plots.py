"""benchmarks/plot_serving.py draws both figures from real result documents and refuses wrong files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pdserve.bench.metrics import SLO, RequestRecord, summarize
from pdserve.bench.report import build_result, write_json
from pdserve.bench.sweep import SCHEMA, system_entry

pytest.importorskip("matplotlib")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plot_serving.py"


def _plot_module():
    spec = importlib.util.spec_from_file_location("plot_serving", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(rate: float, stall: float) -> dict:
    """Four requests of 5 tokens; `stall` is one long decode gap, as a prefill of another request makes."""
    recs = [RequestRecord(i, 8, 5, arrival_time=i * 0.5, send_time=i * 0.5, success=True, ttft=0.1,
                          itl=[0.02, stall, 0.02, 0.02], e2e=0.16 + stall, output_tokens=5) for i in range(4)]
    slo = SLO(ttft_ms=200, tpot_ms=50)
    return build_result(summarize(recs, 2.5, slo), recs, base_url="http://x", model="m", endpoint="/v1/completions",
                        config={"request_rate": rate, "max_concurrency": None}, stopped_early=False)


def test_rates_and_timeline_figures(tmp_path):
    plot = _plot_module()
    runs = {"agg": [_run(0.1, 0.4), _run(0.2, 0.6)], "disagg": [_run(0.1, 0.02), _run(0.2, 0.02)]}
    sweep = {"schema": SCHEMA, "slo": {"ttft_ms": 200.0, "tpot_ms": 50.0}, "attainment_target": 0.9,
             "systems": {n: system_entry("http://x", [{k: v for k, v in r.items() if k != "requests"} for r in rs], 0.9)
                         for n, rs in runs.items()}}
    assert sweep["systems"]["disagg"]["goodput_rate"] == 0.2 and sweep["systems"]["agg"]["goodput_rate"] == 0.0
    write_json(tmp_path / "sweep.json", sweep)
    write_json(tmp_path / "agg.json", runs["agg"][0])
    write_json(tmp_path / "disagg.json", runs["disagg"][0])

    assert plot.main(["rates", str(tmp_path / "sweep.json"), "--out", str(tmp_path / "rates.png")]) == 0
    assert plot.main(["timeline", str(tmp_path / "agg.json"), str(tmp_path / "disagg.json"), "--labels", "agg",
                      "disagg", "--requests", "0", "4", "--out", str(tmp_path / "tl.png")]) == 0
    for png in ("rates.png", "tl.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wrong_inputs_are_named(tmp_path, capsys):
    plot = _plot_module()
    (tmp_path / "vllm.json").write_text(json.dumps({"request_rate": 1.0, "ttfts": []}))
    assert plot.main(["timeline", str(tmp_path / "vllm.json"), "--out", str(tmp_path / "x.png")]) == 2
    assert "not a pdserve run file" in capsys.readouterr().err
    assert plot.main(["rates", str(tmp_path / "vllm.json"), "--out", str(tmp_path / "x.png")]) == 2
    assert "not a sweep file" in capsys.readouterr().err
    write_json(tmp_path / "a.json", _run(0.1, 0.1))
    assert plot.main(["timeline", str(tmp_path / "a.json"), "--labels", "x", "y",
                      "--out", str(tmp_path / "x.png")]) == 2
    assert "one label per file" in capsys.readouterr().err
