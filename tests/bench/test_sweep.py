"""Sweep: DistServe goodput, vLLM result import, and a tiny live sweep against `pdserve serve`."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.cli import main_bench
from pdserve.bench.metrics import SLO
from pdserve.bench.sweep import distserve_goodput, is_monotone, main_sweep, records_from_vllm, summary_of_file


def test_distserve_goodput_is_the_highest_rate_meeting_the_target():
    points = [(0.02, 1.0), (0.05, 0.95), (0.1, 0.9), (0.15, 0.6)]
    assert distserve_goodput(points) == 0.1  # 0.9 counts (>=)
    assert distserve_goodput(points, target=0.96) == 0.02
    assert distserve_goodput([(0.02, 0.89)]) == 0.0
    assert is_monotone(points) and not is_monotone([(0.1, 0.5), (0.2, 0.8)])


def _vllm_detailed() -> dict:
    """The fields vLLM's `bench serve --save-detailed` writes, for 3 requests (one failed)."""
    return {"request_rate": 0.5, "duration": 4.0, "completed": 2,
            "input_lens": [10, 10, 10], "output_lens": [3, 2, 0],
            "ttfts": [0.25, 1.5, 0.0], "itls": [[0.125, 0.125], [0.5], []],
            "errors": ["", "", "Server disconnected"]}


def test_vllm_records_rebuild_latency_and_tpot():
    recs = records_from_vllm(_vllm_detailed())
    assert [r.success for r in recs] == [True, True, False]
    assert recs[0].e2e == 0.5 and recs[0].tpot == 0.125
    assert recs[1].e2e == 2.0 and recs[1].tpot == 0.5
    assert recs[2].error == "Server disconnected"
    with pytest.raises(ValueError, match="--save-detailed"):
        records_from_vllm({"request_rate": 1.0, "duration": 1.0})


def test_vllm_result_file_is_rescored_under_our_slo(tmp_path):
    path = tmp_path / "vllm-r0.5.json"
    path.write_text(json.dumps(_vllm_detailed()))
    s = summary_of_file(path, SLO(ttft_ms=1000, tpot_ms=200))
    # Only request 0 meets both (ttft 250 ms, tpot 125 ms); request 1 misses TTFT; 2 failed.
    assert s["request_rate"] == 0.5 and s["good_requests"] == 1 and s["slo_attainment"] == pytest.approx(1 / 3)
    assert s["request_goodput"] == 0.25 and s["completed"] == 2 and s["run_file"] == str(path)


def test_live_sweep_and_import(server_url, bench_model_dir, tmp_path, capsys):
    out, run_dir = tmp_path / "sweep.json", tmp_path / "runs"
    vllm_file = tmp_path / "vllm-r0.5.json"
    vllm_file.write_text(json.dumps(_vllm_detailed()))
    rc = main_sweep(["--endpoint", f"pd={server_url}", "--from-results", f"other={vllm_file}",
                     "--model", bench_model_dir.name, "--tokenizer", str(bench_model_dir),
                     "--request-rates", "50", "inf", "--num-prompts", "3", "--input-len", "16", "--output-len", "4",
                     "--goodput", "ttft:60000", "tpot:60000", "--cooldown", "0", "--disable-tqdm",
                     "--out", str(out), "--run-dir", str(run_dir)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "pdserve.bench.sweep/1" and doc["slo"] == {"ttft_ms": 60000.0, "tpot_ms": 60000.0}
    pd = doc["systems"]["pd"]
    assert [r["request_rate"] for r in pd["runs"]] == [50.0, "inf"]
    assert all(r["completed"] == 3 and r["total_output_tokens"] == 12 and r["slo_attainment"] == 1.0
               for r in pd["runs"])
    assert pd["goodput_rate"] == "inf"  # every rate met the (generous) SLOs
    for r in pd["runs"]:
        assert json.loads(open(r["run_file"]).read())["schema"] == "pdserve.bench.run/1"
    assert doc["systems"]["other"]["goodput_rate"] == 0.0  # 1/3 attainment at its only rate
    assert all(r["engine_steps"]["tokens"]["decode"] == 3 * 3 for r in pd["runs"])
    assert "engine_steps" not in doc["systems"]["other"]["runs"][0]  # an imported file has no server to ask
    printed = capsys.readouterr().out
    assert "goodput pd:" in printed and "engine busy" in printed

    # the same runs scored under a grid of SLO pairs, without running anything again
    grid_file, plot = tmp_path / "grid.json", tmp_path / "scale.png"
    assert main_bench(["grid", str(out), "--ttft", "60000", "1", "--tpot", "60000", "--reference", "ttft:60000",
                       "--out", str(grid_file), "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    assert "| 60000 | 60000 | 0.0 | inf | pd |" in table and "| 1 | 60000 | 0.0 | 0.0 | - |" in table
    assert "| other | inf | - | - |" in table  # its only rate is 0.5 req/s; pd swept 50 and inf
    grid = json.loads(grid_file.read_text())
    assert grid["schema"] == "pdserve.bench.grid/1" and plot.stat().st_size > 0
    assert all(r["slo_scale"] < 1 for r in grid["slo_scale"]["pd"])  # every request well inside 60 s
    assert grid["slo_scale"]["other"] == [{"request_rate": 0.5, "slo_scale": "inf"}]  # 1 of 3 failed


def test_systems_take_turns_rate_by_rate_in_alternate_order(server_url, bench_model_dir, tmp_path, capsys):
    """Systems compared at one rate run close in time (a drifting machine falls on all of them alike)."""
    out = tmp_path / "sweep.json"
    rc = main_sweep(["--endpoint", f"a={server_url}", "--endpoint", f"b={server_url}",
                     "--model", bench_model_dir.name, "--tokenizer", str(bench_model_dir),
                     "--request-rates", "inf", "50", "100", "--num-prompts", "2", "--input-len", "8",
                     "--output-len", "2", "--goodput", "ttft:60000", "tpot:60000", "--cooldown", "0",
                     "--disable-tqdm", "--out", str(out)])
    assert rc == 0
    order = [line.split(" (")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("== ")]
    assert order == ["== a at 50 req/s", "== b at 50 req/s", "== b at 100 req/s", "== a at 100 req/s",
                     "== a at inf req/s", "== b at inf req/s"]
    doc = json.loads(out.read_text())
    assert list(doc["systems"]) == ["a", "b"]
    assert all([r["request_rate"] for r in doc["systems"][n]["runs"]] == [50.0, 100.0, "inf"] for n in "ab")


def test_grid_needs_a_sweep_with_per_request_records(tmp_path, capsys):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"schema": "pdserve.bench.sweep/1", "attainment_target": 0.9,
                                "systems": {"a": {"runs": [{"request_rate": 1.0}]}}}))
    assert main_bench(["grid", str(path)]) == 2
    assert "rerun `pdserve bench sweep` with --run-dir" in capsys.readouterr().err
    path.write_text(json.dumps({"schema": "other"}))
    assert main_bench(["grid", str(path)]) == 2
    assert "is not a `pdserve bench sweep` result" in capsys.readouterr().err
    assert main_bench(["grid", str(path), "--tpot", "0"]) == 2


def test_sweep_needs_slos_and_systems(capsys):
    assert main_bench(["sweep", "--model", "m", "--out", "x.json", "--endpoint", "a=http://h"]) == 2
    assert "pdserve bench sweep: error" in (err := capsys.readouterr().err) and "--goodput" in err
    assert main_sweep(["--model", "m", "--out", "x.json", "--goodput", "ttft:1"]) == 2
    assert "nothing to sweep" in capsys.readouterr().err
    assert main_sweep(["--model", "m", "--out", "x.json", "--goodput", "ttft:1", "--endpoint", "nourl"]) == 2
    assert "NAME=VALUE" in capsys.readouterr().err
