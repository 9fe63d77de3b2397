"""`pdserve plan` end to end on a tiny model: a real profile (engine steps in child processes, KV writes
through the transfer agents, a real `pdserve launch` probed over HTTP), the ranked table, the pick's
cluster.yaml, and the errors a user can make."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from openai import OpenAI

from pdserve.cli import main
from pdserve.host import free_port
from pdserve.launch.config import load_cluster_config, worker_configs
from pdserve.plan.profile import Profile, load_or_measure, thread_counts, usable_cores
from pdserve.testing.tiny import make_tiny_model
from pdserve.testing.wait import reaped, stop_cleanly, wait_for_line

pytestmark = pytest.mark.skipif(len(usable_cores()) < 2, reason="the serving probe pins two instances to two cores")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("PDSERVE_CACHE_DIR")
    os.environ["PDSERVE_CACHE_DIR"] = str(cache)
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), num_layers=2, num_heads=4, num_kv_heads=2)
    try:
        yield str(model)
    finally:
        if old is None:
            os.environ.pop("PDSERVE_CACHE_DIR", None)
        else:
            os.environ["PDSERVE_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def planned(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    rc = main(["plan", "--model", tiny, "--slo", "ttft:2000,tpot:200", "--input-len", "256", "--output-len", "16",
               "--out", str(out / "cluster.yaml"), "--json", str(out / "plan.json"), "--rates", "1", "4", "16",
               "--grid-ttft", "100", "2000", "--grid-tpot", "50", "200"])
    assert rc == 0
    return out


def test_the_profile_holds_every_measurement_and_is_cached(tiny, planned):
    profile, path, fresh = load_or_measure(tiny, progress=False)
    assert not fresh and path.exists()
    assert isinstance(Profile.from_dict(json.loads(path.read_text())), Profile)
    assert profile.units == thread_counts(len(usable_cores()))
    for t in profile.steps.values():
        assert len(t.prefill) >= 6 and all(s > 0 for s in t.prefill.values())
        assert len(t.decode) >= 10 and t.chunk[2] > 0
    assert "shm" in profile.transfer and all(s > 0 for _, s in profile.transfer["shm"])
    bigger = [f"aggregated@{t}" for t in profile.units if t > 1]  # each larger instance size, on its own
    assert sorted(profile.serving) == sorted(["aggregated", "disaggregated", *bigger]) and bigger
    for kind in profile.serving:
        probe = profile.serving[kind]
        assert probe["ttft_s"] >= 0 and probe["itl_s"] >= 0 and probe["itl_row_s"] >= 0
        assert 0.8 <= probe["prefill_factor"] <= 3
        # the prefilling engine's own step timer, at each probed prompt length
        assert 0.8 <= probe["step_factor"] <= 3 and probe["step_ttft_s"] >= 0
        assert sorted(probe["step_measured_s"]) == sorted(probe["ttft_measured_s"])
        assert all(s > 0 for s in probe["step_measured_s"].values())


def test_the_pick_is_a_cluster_yaml_launch_accepts(planned):
    doc = json.loads((planned / "plan.json").read_text())
    assert doc["schema"] == "pdserve.plan/1" and doc["candidates"][0]["name"] == doc["pick"]
    goodputs = [c["goodput"] for c in doc["candidates"]]
    assert goodputs == sorted(goodputs, reverse=True) and goodputs[0] > 0
    cfg = load_cluster_config(str(planned / "cluster.yaml"))
    worker_configs(cfg)
    assert yaml.safe_load((planned / "cluster.yaml").read_text()) == doc["candidates"][0]["cluster"]
    grid = doc["grid"]
    assert grid["schema"] == "pdserve.bench.grid/1" and len(grid["cells"]) == 4
    tight = next(c for c in grid["cells"] if c["ttft_ms"] == 100 and c["tpot_ms"] == 50)
    loose = next(c for c in grid["cells"] if c["ttft_ms"] == 2000 and c["tpot_ms"] == 200)
    assert all(loose["goodput"][s] >= tight["goodput"][s] for s in grid["systems"])


@pytest.mark.parametrize("argv,error", [
    (["--slo", "ttft:100"], "needs both budgets"),
    (["--slo", "ttft:100,tpot:10", "--input-len", "0"], "must be >= 1 token"),
    (["--slo", "ttft:100,tpot:10", "--input-len", "4000"], "exceeds the model's context window"),
    (["--slo", "ttft:100,tpot:10", "--rate", "nan"], "positive number"),
    (["--slo", "ttft:100,tpot:10", "--ctx-layout", "tp3"], "one must divide the other"),
    (["--slo", "ttft:100,tpot:10", "--device", "cuda", "--backend", "shm"], "use --backend nixl"),
])
def test_a_bad_request_is_a_clear_error(tiny, planned, tmp_path, capsys, argv, error):
    assert main(["plan", "--model", tiny, "--out", str(tmp_path / "c.yaml"), *argv]) == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "c.yaml").exists(), "a failed plan wrote a cluster.yaml"


def test_an_out_path_in_no_directory_is_refused_before_profiling(tiny, tmp_path, capsys):
    """Before, the profile ran (about 2 minutes on a fresh model) and then the write failed with Errno 2."""
    started = time.monotonic()
    assert main(["plan", "--model", tiny, "--slo", "ttft:100,tpot:10", "--reprofile",
                 "--out", str(tmp_path / "missing" / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "missing does not exist" in err, err
    assert time.monotonic() - started < 10


def test_a_plan_whose_candidates_move_no_kv_needs_no_transfer_timings(tiny, planned):
    # One unit (a single GPU, or one core) has no disaggregated candidate: a profile without the backend's
    # timings (CUDA without nixl) still plans. Before, every plan failed on the missing timings.
    from argparse import Namespace

    from pdserve.plan.run import plan
    from pdserve.plan.planner import PlanSLO

    profile, _, _ = load_or_measure(tiny, progress=False)
    one = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    one.steps = {1: one.steps[1]}
    one.key = dict(one.key, units=1)
    one.transfer = {}
    args = Namespace(input_len=256, output_len=16, backend="nixl", attainment=0.9, rate=None, rates=[1, 4])
    preds, _ = plan(args, PlanSLO(2000, 200), one)
    assert preds and all(p.candidate.kind == "aggregated" for p in preds)
    with pytest.raises(ValueError, match="no nixl transfer timings"):
        plan(args, PlanSLO(2000, 200), Profile.from_dict(dict(profile.to_dict(), transfer={})))


def test_the_transfer_timings_are_of_the_memory_the_device_pools_are_in():
    from pdserve.plan.profile import default_backend, transfer_backends

    assert "shm" not in transfer_backends("cuda"), "shm moves host memory: on CUDA it times the wrong memory"
    assert transfer_backends("cpu")[0] == "shm"
    assert (default_backend("cpu"), default_backend("cuda")) == ("shm", "nixl")


def test_launch_refuses_an_slo_nothing_here_meets(tiny, planned, capsys):
    rc = main(["launch", "--model", tiny, "--slo", "ttft:1,tpot:1", "--input-len", "256", "--output-len", "16"])
    assert rc == 1
    assert "loosen the SLO" in capsys.readouterr().err


def test_launch_with_an_slo_starts_the_pick_and_serves(tiny, planned, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "launch", "--model", tiny, "--slo", "ttft:5000,tpot:500",
            "--input-len", "256", "--output-len", "16", "--port", str(port)]
    with reaped(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)) as proc:
        banner = wait_for_line(proc, "ready: OpenAI API", timeout=180)
        pick = json.loads((planned / "plan.json").read_text())["pick"]
        assert "(cached:" in banner and "pdserve launch: launching " in banner
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        got = client.completions.create(model=client.models.list().data[0].id, prompt="The quick brown fox",
                                        max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == 5, pick
        stop_cleanly(proc)
