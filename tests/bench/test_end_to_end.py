"""`pdserve bench` against a real `pdserve serve` process over a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from pdserve.bench.cli import main_bench
from pdserve.bench.sweep import main_sweep
from pdserve.host import free_port
from pdserve.testing.wait import reaped, stop_cleanly, wait_for_line

INPUT_LEN, OUTPUT_LEN, NUM = 32, 8, 8


def _bench(server_url, bench_model_dir, *extra: str) -> int:
    return main_bench(["--base-url", server_url, "--model", bench_model_dir.name, "--tokenizer", str(bench_model_dir),
                       "--disable-tqdm", *extra])


def test_poisson_run_results_are_complete_and_consistent(server_url, bench_model_dir, tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = _bench(server_url, bench_model_dir, "--num-prompts", str(NUM), "--request-rate", "40", "--seed", "5",
                "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                "--goodput", "ttft:60000", "tpot:60000", "--result-json", str(out))
    assert rc == 0
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms):" in table and "P99 ITL (ms):" in table

    doc = json.loads(out.read_text())
    assert doc["schema"] == "pdserve.bench.run/1" and doc["model"] == bench_model_dir.name
    assert doc["config"]["request_rate"] == 40.0 and doc["config"]["goodput"] == {"ttft_ms": 60000.0,
                                                                                   "tpot_ms": 60000.0}
    assert (doc["completed"], doc["failed"], doc["stopped_early"]) == (NUM, 0, False)
    assert doc["total_output_tokens"] == NUM * OUTPUT_LEN
    assert doc["total_input_tokens"] == NUM * INPUT_LEN  # the server's usage agrees with the id prompts
    assert doc["good_requests"] == NUM and doc["slo_attainment"] == 1.0
    assert doc["request_goodput"] == pytest.approx(doc["request_throughput"]) == pytest.approx(NUM / doc["duration"])
    assert doc["output_throughput"] == pytest.approx(NUM * OUTPUT_LEN / doc["duration"])

    reqs = doc["requests"]
    assert [r["index"] for r in reqs] == list(range(NUM))
    for r in reqs:
        assert r["success"] and r["error"] == "" and r["output_tokens"] == OUTPUT_LEN
        # One SSE chunk per token from pdserve: OUTPUT_LEN - 1 gaps, and they add up to E2E - TTFT.
        assert len(r["itl"]) == OUTPUT_LEN - 1
        assert r["e2e"] == pytest.approx(r["ttft"] + sum(r["itl"]), abs=1e-6)
        assert 0 < r["ttft"] < r["e2e"] <= doc["duration"]
        assert r["arrival_time"] <= r["send_time"] + 1e-3
    # Poisson at 40 req/s, seeded: the releases are spread out, not all at t = 0.
    assert reqs[-1]["arrival_time"] > 0.01
    tpots = [(r["e2e"] - r["ttft"]) / (OUTPUT_LEN - 1) * 1000 for r in reqs]
    assert doc["mean_tpot_ms"] == pytest.approx(sum(tpots) / NUM)

    # The server's engine during the run (two scrapes of its /metrics; the warm-up request is before the first).
    steps = doc["engine_steps"]
    assert steps["tokens"]["decode"] == NUM * (OUTPUT_LEN - 1)  # each first token is sampled by its prompt's step
    assert 0 < steps["tokens"]["prefill"] <= NUM * INPUT_LEN  # prefix-cache hits are not computed
    assert sum(k["steps"] for k in steps["kinds"].values()) >= OUTPUT_LEN
    assert 0 < steps["busy_fraction"] <= 1
    assert "Engine busy (% of duration):" in table


def test_max_duration_stops_the_run_and_names_why(server_url, bench_model_dir, tmp_path):
    out = tmp_path / "cut.json"
    t = time.monotonic()
    # 8 output tokens: a request finishes within the second even on a loaded machine (64 at a 26 ms step did not)
    rc = _bench(server_url, bench_model_dir, "--num-prompts", "500", "--max-concurrency", "2",
                "--input-len", "16", "--output-len", "8", "--max-duration", "1.0", "--result-json", str(out))
    assert time.monotonic() - t < 15
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["stopped_early"] and doc["duration"] < 2.0
    assert doc["completed"] + doc["failed"] == 500 and doc["failed"] > 0
    errors = {r["error"].split(":")[0] for r in doc["requests"] if not r["success"]}
    assert errors <= {"cancelled", "not sent"} and "not sent" in errors


def test_wrong_model_is_a_clear_error(server_url, bench_model_dir, capsys):
    rc = main_bench(["--base-url", server_url, "--model", "no-such-model", "--tokenizer", str(bench_model_dir),
                     "--num-prompts", "2", "--disable-tqdm"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "HTTP 404" in err and "--model" in err


def test_behind_the_orchestrator_the_named_instances_steps_are_recorded(bench_model_dir, tmp_path, capsys):
    """`pdserve launch` of two aggregated instances behind the orchestrator, which runs no engine: a run
    through it records nothing of the engines' steps unless --engine-metrics names the instances; then their
    counters add up to the whole run (every decode token, whichever instance served it)."""
    port = free_port()
    inst = {"config": {"num_threads": 1, "kv_cache_memory_gb": 0.0625}}  # a small pool: quick to start
    (tmp_path / "agg.yaml").write_text(yaml.safe_dump({
        "model": str(bench_model_dir), "port": port, "context": [], "log_dir": str(tmp_path / "logs"),
        "generation": [dict(inst, port=port + 1), dict(inst, port=port + 2)]}))
    argv = [sys.executable, "-m", "pdserve.cli", "launch", str(tmp_path / "agg.yaml")]
    with reaped(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)) as proc:
        wait_for_line(proc, "ready: OpenAI API", timeout=120)
        url = f"http://127.0.0.1:{port}"
        instances = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
        work = ["--num-prompts", str(NUM), "--request-rate", "inf", "--input-len", str(INPUT_LEN),
                "--output-len", str(OUTPUT_LEN)]
        plain, named = tmp_path / "plain.json", tmp_path / "named.json"
        assert _bench(url, bench_model_dir, *work, "--result-json", str(plain)) == 0
        assert json.loads(plain.read_text())["engine_steps"] is None
        assert _bench(url, bench_model_dir, *work, "--seed", "1", "--engine-metrics", *instances,
                      "--result-json", str(named)) == 0
        steps = json.loads(named.read_text())["engine_steps"]
        assert steps["instances"] == 2 and steps["tokens"]["decode"] == NUM * (OUTPUT_LEN - 1)
        assert 0 < steps["busy_fraction"] <= 1
        assert "Engine steps, 2 instances" in capsys.readouterr().out

        out = tmp_path / "sweep.json"
        assert main_sweep(["--endpoint", f"agg={url}", "--engine-metrics", "agg=" + ",".join(instances),
                           "--model", bench_model_dir.name, "--tokenizer", str(bench_model_dir), "--seed", "2",
                           "--request-rates", "inf", "--num-prompts", "4", "--input-len", str(INPUT_LEN),
                           "--output-len", "4", "--goodput", "ttft:60000", "tpot:60000", "--cooldown", "0",
                           "--disable-tqdm", "--out", str(out)]) == 0
        run = json.loads(out.read_text())["systems"]["agg"]["runs"][0]
        assert run["engine_steps"]["instances"] == 2 and run["engine_steps"]["tokens"]["decode"] == 4 * 3
        stop_cleanly(proc)


def test_engine_metrics_must_name_servers_and_endpoints(bench_model_dir, tmp_path, capsys):
    assert _bench("http://127.0.0.1:9", bench_model_dir, "--engine-metrics", "127.0.0.1:8001") == 2
    assert "--engine-metrics takes server roots" in capsys.readouterr().err
    assert main_sweep(["--endpoint", "a=http://127.0.0.1:9", "--engine-metrics", "b=http://127.0.0.1:8001",
                       "--model", "m", "--goodput", "ttft:1", "--out", str(tmp_path / "s.json")]) == 2
    assert "no --endpoint is named 'b'" in capsys.readouterr().err
