"""`pdserve launch`: a whole cluster from one command, a real request through it, and a clean stop
that leaves no process behind."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Literal

import httpx
import openai
import psutil
import pytest
import yaml
from openai import OpenAI
from pydantic import BaseModel, Field

from pdserve.cli import main
from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.host import free_port
from pdserve.launch.backoff import RestartBackoff
from pdserve.launch.config import ClusterConfig, worker_configs
from pdserve.testing import make_tiny_model
from pdserve.testing.wait import reaped, stop_cleanly, wait_for_line

# A KV pool of 64 MiB: a server zeroes its whole pool at start, and the default 1 GiB took ~1.5 s of it here.
POOL = {"kv_cache_memory_gb": 0.0625}
SMALL_POOL = {"tokens_per_block": 8, **POOL}


def _launch(tmp_path, cluster: dict, *flags: str) -> subprocess.Popen:
    """`pdserve launch` over `cluster` written as cluster.yaml, its stdout and stderr in one text pipe."""
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    return subprocess.Popen([sys.executable, "-m", "pdserve.cli", "launch", str(path), *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.fixture
def tiny(tmp_path):
    return str(make_tiny_model(tmp_path / "m", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16))


def test_launch_serves_disaggregated_and_stops_cleanly(tmp_path, tiny):
    """The model and the public port come from the command line (before, without --slo, --model and --port
    were ignored: the default model answered on :8000)."""
    port = free_port()
    cluster = {"log_dir": str(tmp_path / "logs"), "backend": "shm",
               "context": [{"port": free_port(), "config": SMALL_POOL}],
               "generation": [{"port": free_port(), "config": SMALL_POOL}]}
    with reaped(_launch(tmp_path, cluster, "--model", tiny, "--port", str(port))) as proc:
        banner = wait_for_line(proc, "ready: OpenAI API", timeout=180)
        assert "ctx0" in banner and "gen0" in banner and "orchestrator" in banner
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 3
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        prompt = "The quick brown fox"
        got = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        with LLM(EngineConfig(model=tiny, tokens_per_block=8)) as llm:
            want = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        assert got.choices[0].text == want.text
        assert got.usage.completion_tokens == 12
        _structured_and_tool_calls(client)
        out = stop_cleanly(proc)
        assert "stopped." in out
        deadline = time.monotonic() + 10
        while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
            assert time.monotonic() < deadline, "processes outlived pdserve launch"
            time.sleep(0.2)


class Item(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)  # bounded: a random model's digits would run on past max_tokens


ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}


def _structured_and_tool_calls(client: OpenAI) -> None:
    """Through the launched cluster (disaggregated): a json_schema answer parses into its pydantic model, and a
    required tool call names the tool with arguments its schema takes (issue 44's done-when)."""
    ask = [{"role": "user", "content": "An item, please"}]
    reply = client.chat.completions.parse(model="m", messages=ask, response_format=Item, max_tokens=40,
                                          temperature=0)
    assert isinstance(reply.choices[0].message.parsed, Item), reply.choices[0].message.content
    tools = [{"type": "function", "function": {"name": "add", "description": "Sum", "parameters": ADD}}]
    reply = client.chat.completions.create(model="m", messages=ask, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=100, temperature=0)
    assert reply.choices[0].message.tool_calls, reply
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    args = json.loads(call.function.arguments)
    assert set(args) == {"a", "b"} and all(0 <= v <= 99 for v in args.values()), args


def test_launch_without_context_instances_serves_aggregated_and_dies_with_its_servers(tmp_path, tiny):
    """`context: []` (what `pdserve plan` writes for an aggregated pick): the generation instances serve
    whole requests behind the orchestrator, which needs no context instance to be healthy.

    Then SIGKILL: it gives `pdserve launch` no chance to stop its members (each in its own session); the
    kernel sends them SIGTERM when it dies (PR_SET_PDEATHSIG). Before, they ran on, holding their ports."""
    port = free_port()
    cluster = {"model": tiny, "port": port, "log_dir": str(tmp_path / "logs"), "context": [],
               "generation": [{"port": free_port(), "config": POOL}, {"port": free_port(), "config": POOL}]}
    with reaped(_launch(tmp_path, cluster)) as proc:
        banner = wait_for_line(proc, "ready: OpenAI API", timeout=180)
        assert "aggregated, 2 instance(s)" in banner and "gen1" in banner and "ctx0" not in banner
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        prompt = "The quick brown fox"
        with LLM(EngineConfig(model=tiny)) as llm:
            want = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        for _ in range(2):
            got = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert got.choices[0].text == want.text
        gen_conf = yaml.safe_load((tmp_path / "logs" / "gen0.yaml").read_text())
        assert "backend" not in gen_conf["cache_transceiver_config"]  # nothing moves KV (it holds the cluster token)

        members = psutil.Process(proc.pid).children()
        assert len(members) == 3  # gen0, gen1 and the orchestrator
        proc.kill()
        proc.wait(timeout=10)
        _, alive = psutil.wait_procs(members, timeout=60)
        assert not alive, f"{[m.cmdline() for m in alive]} outlived a killed pdserve launch"


@pytest.mark.parametrize("text,says", [
    (yaml.safe_dump({"context": [{"port": 9001, "config": {"tensor_parallel_size": 0}}]}), "tensor_parallel_size"),
    ("model: [unclosed\n", "is not valid YAML"),  # was a traceback
    ("- a\n- list\n", "must hold a mapping of keys to values, not list"),  # named Python's ** argument
    # the kernel pinned to the cores that exist and said nothing of the others
    (yaml.safe_dump({"generation": [{"cpus": [0, 4095]}]}), "gen0 is pinned to cores [0, 4095], and [4095] is not"),
], ids=["bad-worker-key", "bad-yaml", "a-list", "missing-core"])
def test_launch_refuses_a_bad_cluster_config(tmp_path, text, says):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "launch", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "ready" not in out.stdout  # nothing was started


@pytest.mark.parametrize("instance,says", [
    ({"config": {"tensor_parallel_size": 3}}, "gen0: tensor_parallel_size=3 cannot split this model (4 attention "
                                              "heads, 2 KV heads, intermediate_size 64): use one of [1, 2, 4]"),
    ({"config": {"pipeline_parallel_size": 3}}, "gen0: pipeline_parallel_size=3 exceeds the model's 2 layers"),
    ({"config": {"model": "/nonexistent/model"}}, "gen0: "),
], ids=["tp", "pp", "no-model"])
def test_launch_refuses_a_layout_the_model_cannot_take_before_starting_anything(tmp_path, tiny, instance, says):
    """Before, the context instance (and the orchestrator) started, and the launch stopped them when the
    generation instance failed."""
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"model": tiny, "log_dir": str(tmp_path / "logs"), "backend": "shm",
                                    "context": [{}], "generation": [instance]}))
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "launch", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "logs in" not in out.stdout and not (tmp_path / "logs").exists()  # no instance was started


@pytest.mark.parametrize("argv,says", [
    (["--input-len", "64"], "--input-len is for planning the deployment: add --slo"),
    (["cluster.yaml", "--dtype", "bfloat16"], "--dtype would set every instance of cluster.yaml"),
    (["cluster.yaml", "--slo", "ttft:100,tpot:10"], "give either cluster.yaml or --slo"),
], ids=["planning-flag", "instance-flag-with-a-file", "slo-with-a-file"])
def test_launch_flags_that_would_do_nothing_are_refused(argv, says, capsys):
    assert main(["launch", *argv]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("n", ["0", "-1"])
def test_scale_refuses_an_empty_role_before_it_looks_for_a_cluster(n, capsys):
    """Nothing listens at the address: a count below 1 is refused without trying to reach it."""
    started = time.monotonic()
    assert main(["scale", "context", n, "--ray", f"127.0.0.1:{free_port()}"]) == 1
    assert "at least one context instance" in capsys.readouterr().err
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("command", ["scale", "launch"])
def test_a_ray_address_where_nothing_listens_is_an_error_in_seconds(command, tmp_path, tiny):
    """ray.init retries such an address for minutes (it hung past 5 min here); pdserve says so at once."""
    if importlib.util.find_spec("ray") is None:  # not imported here: test_launch_ray sets Ray's env before that
        pytest.skip("needs Ray: pip install 'pdserve[ray]'")
    address = f"127.0.0.1:{free_port()}"
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"model": tiny, "context": [{}], "generation": [{}]}))
    args = {"scale": ["scale", "context", "2", "--ray", address], "launch": ["launch", "--ray", address, str(path)]}
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", *args[command]], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and f"nothing answers at {address}" in out.stderr, out.stderr


def test_context_instances_keep_one_copy_of_their_weights():
    """A launched context instance only prefills: no batch-1 decode copy of its weights unless its own
    config asks for one; a generation instance keeps the engine's default."""
    cfg = ClusterConfig(context=[{"port": 9101}, {"port": 9102, "config": {"cpu_decode_gemv": True}}],
                        generation=[{"port": 9103}])
    ctx0, ctx1, gen0 = worker_configs(cfg)
    assert ctx0["cpu_decode_gemv"] is False and ctx1["cpu_decode_gemv"] is True
    assert "cpu_decode_gemv" not in gen0


def test_the_restart_wait_doubles_up_to_its_cap_and_starts_over_after_a_long_run():
    backoff = RestartBackoff(first_s=1, doublings=5, reset_after_s=60)
    waits = [backoff.failed(uptime_s=3) for _ in range(8)]
    assert waits == [1, 2, 4, 8, 16, 32, 32, 32] and backoff.cap_s == 32
    assert backoff.failed(uptime_s=60) == 1 and backoff.failed(uptime_s=59) == 2  # a long run starts it over
    assert (backoff.total, backoff.in_a_row) == (10, 2)
    default = ClusterConfig()
    assert RestartBackoff(default.restart_backoff_s, default.max_restarts, default.restart_reset_s).cap_s == 32


def test_a_restart_wait_past_five_minutes_is_refused_naming_the_keys():
    """max_restarts: 20 was a restart budget; now it counts doublings, and 2^20 s is no wait to sit out."""
    with pytest.raises(ValueError, match=r"max_restarts 20 with restart_backoff_s 1 would wait up to 1\.04858e\+06 s"
                                         r".*lower it so that restart_backoff_s \* 2\^max_restarts <= 300"):
        ClusterConfig(max_restarts=20)
    assert ClusterConfig(max_restarts=0, restart_backoff_s=300).max_restarts == 0  # 300 s: the most allowed


@pytest.mark.faults
def test_launch_keeps_restarting_a_member_that_keeps_dying(tmp_path, tiny):
    """kill -9 of the context instance, then of each restart of it as soon as it starts (a crash loop, 4 deaths
    where max_restarts is 1): launch restarts it every time, after a wait that doubles up to its cap, and the
    cluster serves the same answer through the same orchestrator afterwards. Meanwhile the orchestrator
    answers 503 with Retry-After, and its /metrics counts the ready instance it saw fail. Before, the second
    death stopped the whole cluster ("ctx0 exited with code -9 after 1 restart(s); stopping the cluster")."""
    port, ctx_port = free_port(), free_port()
    logs = tmp_path / "logs"
    cluster = {"model": tiny, "port": port, "log_dir": str(logs), "backend": "shm",
               "restart_backoff_s": 0.2, "max_restarts": 1, "orchestrator": {"health_check_interval": 0.5},
               "context": [{"port": ctx_port, "config": SMALL_POOL}],
               "generation": [{"port": free_port(), "config": SMALL_POOL}]}
    with reaped(_launch(tmp_path, cluster)) as proc:
        wait_for_line(proc, "ready: OpenAI API", timeout=180)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        ask = dict(model="m", prompt=list(range(5, 60)), max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        before = client.completions.create(**ask).choices[0].text
        ctx = next(c for c in psutil.Process(proc.pid).children(recursive=True)
                   if any(str(ctx_port) in a or "ctx0.yaml" in a for a in c.cmdline()))
        os.killpg(ctx.pid, signal.SIGKILL)
        said = ""
        for _ in range(3):  # each restart killed as soon as it runs
            said += wait_for_line(proc, "ctx0 restarted (pid ", timeout=30)
            os.killpg(int(said.rsplit("(pid ", 1)[1].split(")")[0]), signal.SIGKILL)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={**{k: v for k, v in ask.items() if k != "extra_body"}, "ignore_eos": True})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_ready_instance", r.text
        assert r.headers["retry-after"] == "2"
        said += wait_for_line(proc, "ctx0 restarted (pid ", timeout=30)
        waits = [float(w) for w in re.findall(r"ctx0 exited with code -9 after [\d.]+ s \(failure \d+, \d+ in a row\); "
                                              r"restarting it in ([\d.]+) s", said)]
        assert waits == [0.2, 0.4, 0.4, 0.4], said  # doubled max_restarts times, then capped
        assert "failure 4, 4 in a row" in said and "stopping the cluster" not in said
        answer, started = None, time.monotonic()  # the fourth restart is running
        while answer is None and time.monotonic() - started < 90:
            try:
                answer = client.completions.create(**ask).choices[0].text
            except openai.APIStatusError as e:  # 503 until the restarted instance is ready and routed to again
                assert e.status_code == 503, e
                time.sleep(0.5)
        assert answer == before
        print(f"4 deaths of ctx0 in a row: the same answer {time.monotonic() - started:.1f} s after its last restart")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10,
                            headers={"X-Cluster-Token": (logs / "cluster_token").read_text().strip()}).text
        assert 'pdserve_orchestrator_instance_failures_total{role="context"} 1.0' in metrics, metrics
        assert proc.poll() is None
        stop_cleanly(proc)
