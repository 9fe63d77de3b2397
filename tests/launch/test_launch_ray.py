"""`pdserve launch --ray` on a real two-node Ray cluster on this machine (two raylets, one CPU each, on
127.0.0.1), instances spread over the nodes, KV over NIXL between them, and `pdserve scale` while it
serves (issue 17, section 2)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest
import yaml
from openai import OpenAI

from pdserve.host import free_port
from pdserve.launch.ray_cluster import CONTROLLER, NAMESPACE
from pdserve.testing import make_tiny_model
from pdserve.testing.wait import wait_for_line, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Ray gives its nodes the machine's routable address unless this says it is one machine: then every
# node, driver and actor stays on 127.0.0.1.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}


@pytest.fixture(scope="module")
def ray_cluster():
    saved = {k: os.environ.get(k) for k in LOOPBACK}
    os.environ.update(LOOPBACK)  # before Ray is imported: it reads this once
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    cluster.add_node(**NODE)
    try:
        yield cluster
    finally:
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _pdserve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **LOOPBACK})


def _served(url: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.TransportError:  # a restarted actor knows its port before its server listens
        return 0.0
    return sum(float(v) for v in re.findall(r"^pdserve_request_success_total\{[^}]*\} (\S+)$", text, re.M))


def _gone(pid: int) -> bool:
    """The process exited (a zombie waiting for its reaper counts: it runs nothing)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _restarted(controller, before: dict) -> bool:
    import ray

    (now,) = ray.get(controller.status.remote())["context"]
    return "dead" not in now and now["actor_pid"] != before["actor_pid"]


@pytest.mark.timeout(1500)  # its own waits (Ray's start, two scale calls, the stop) add up to 960 s
def test_a_cluster_on_ray_serves_survives_a_killed_actor_and_scales(ray_cluster, tmp_path):
    import ray

    model = make_tiny_model(tmp_path / "m", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    port = free_port()
    # a generation instance waiting for KV from a context instance that was killed gives up after 4 s
    # (the orchestrator then prefills again), as in tests/orchestrator/test_peer_death.py
    # (and a KV pool of 64 MiB, quick to zero at start)
    worker = {"tokens_per_block": 8, "kv_cache_memory_gb": 0.0625,
              "cache_transceiver_config": {"kv_transfer_timeout_ms": 4000, "rank_info_timeout_s": 2.0}}
    cluster = {"model": str(model), "port": port, "backend": "nixl", "log_dir": str(tmp_path / "logs"),
               "context": [{"config": worker}], "generation": [{"config": worker}],
               "orchestrator": {"lease_ttl_s": 3, "health_check_interval": 0.5}, "max_restarts": 1,
               "restart_backoff_s": 0.5,
               "ray": {"placement_timeout_s": 3, "placement": "spread", "cpus_per_rank": 0.5}}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    launch = _pdserve("launch", "--ray", ray_cluster.address, str(tmp_path / "cluster.yaml"))
    ray.init(address=ray_cluster.address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
    try:
        banner = wait_for_line(launch, "ready: OpenAI API", timeout=240)
        controller = ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        status = ray.get(controller.status.remote())
        (ctx,), (gen,), (orch,) = status["context"], status["generation"], status["orchestrator"]
        assert ctx["node_id"] != gen["node_id"], banner  # spread, though one node has room for both
        assert orch["url"] == f"http://127.0.0.1:{port}"

        # disaggregated through the orchestrator == the generation instance alone, token for token
        body = dict(model="m", prompt="The capital of France is", max_tokens=12, temperature=0,
                    extra_body={"ignore_eos": True})
        expected = OpenAI(base_url=gen["url"] + "/v1", api_key="x").completions.create(**body).choices[0].text
        client = OpenAI(base_url=orch["url"] + "/v1", api_key="x", max_retries=0)
        assert client.completions.create(**body).choices[0].text == expected

        # the context instance's actor killed: Ray starts it again, its server joins again, serving resumes
        killed = time.monotonic()
        os.kill(ctx["actor_pid"], signal.SIGKILL)
        deadline = killed + 120
        while True:
            try:
                if client.completions.create(**body).choices[0].text == expected:
                    break
            except Exception:  # 503 until the new server joined; the test bounds the wait
                pass
            assert time.monotonic() < deadline, f"no answer {time.monotonic() - killed:.0f} s after the kill"
            time.sleep(0.2)
        resumed_after = time.monotonic() - killed
        # that answer may still have come from the old server, its SIGTERM (PR_SET_PDEATHSIG) on the way:
        # it drains and exits, and Ray's new actor starts a server that joins and takes the requests
        assert wait_until(lambda: _gone(ctx["server_pid"]), timeout_s=60, poll_s=0.1), \
            f"the killed actor's server {ctx['server_pid']} still runs 60 s after its actor died"
        assert wait_until(lambda: _restarted(controller, ctx), timeout_s=120, poll_s=0.5), \
            ray.get(controller.status.remote())["context"]
        (ctx2,) = ray.get(controller.status.remote())["context"]
        assert ctx2["starts_in_s"] == 0.5
        # killed again at once: 2 deaths where max_restarts is 1 (before, Ray's budget: the actor stayed dead),
        # the restart waiting twice as long, restart_backoff_s * 2^max_restarts
        os.kill(ctx2["actor_pid"], signal.SIGKILL)
        assert wait_until(lambda: _restarted(controller, ctx2), timeout_s=60, poll_s=0.2), \
            ray.get(controller.status.remote())["context"]
        (ctx2,) = ray.get(controller.status.remote())["context"]
        assert ctx2["starts_in_s"] == 1.0, ctx2
        # the new actor is up before its server has joined: until then the orchestrator has no context
        # server and says so (503 no_ready_instance); nothing else may fail
        deadline = time.monotonic() + 60
        while _served(ctx2["url"]) == 0:
            try:
                assert client.completions.create(**body).choices[0].text == expected
            except openai.InternalServerError as e:
                assert e.status_code == 503 and e.code == "no_ready_instance", e
                time.sleep(0.2)
            assert time.monotonic() < deadline, "the restarted context instance took no request in 60 s"
        restarted_after = time.monotonic() - killed

        # context 1 -> 2 while serving: a third node comes up, `pdserve scale` places an instance there
        ray_cluster.add_node(**NODE)
        started = time.monotonic()
        scale = _pdserve("scale", "context", "2", "--ray", ray_cluster.address)
        out, _ = scale.communicate(timeout=240)
        assert scale.returncode == 0, out
        scaled_after = time.monotonic() - started
        contexts = ray.get(controller.status.remote())["context"]
        assert len(contexts) == 2 and len({c["node_id"] for c in contexts} | {gen["node_id"]}) == 3
        for _ in range(8):
            assert client.completions.create(**body).choices[0].text == expected
        assert all(_served(c["url"]) > 0 for c in contexts), "the new context instance took no request"
        servers = [c["server_pid"] for c in contexts] + [gen["server_pid"]]

        # every node holds an instance: spread has no room for a third one (though CPUs are free), a
        # clear error within ray.placement_timeout_s, and nothing changed
        scale = _pdserve("scale", "context", "3", "--ray", ray_cluster.address)
        out, _ = scale.communicate(timeout=120)
        assert scale.returncode == 1 and "no room for a context instance" in out and "spread" in out, out
        assert len(ray.get(controller.status.remote())["context"]) == 2
        # (a count below 1: tests/launch/test_launch.py, no cluster needed)

        # 2 -> 1: the newest one drains (leaves, finishes, exits) and is gone
        started = time.monotonic()
        scale = _pdserve("scale", "context", "1", "--ray", ray_cluster.address)
        out, _ = scale.communicate(timeout=240)
        assert scale.returncode == 0, out
        down_after = time.monotonic() - started
        (left,) = ray.get(controller.status.remote())["context"]
        assert left["url"] == contexts[0]["url"] and _gone(contexts[1]["server_pid"])
        for _ in range(4):
            assert client.completions.create(**body).choices[0].text == expected
        print(f"killed context actor -> answering after {resumed_after:.1f} s, its restart serving after "
              f"{restarted_after:.1f} s; pdserve scale context 2 "
              f"took {scaled_after:.1f} s, scale context 1 {down_after:.1f} s (Ray connect, Python start and "
              "model load included)")
    finally:
        launch.send_signal(signal.SIGTERM)
        try:
            out, _ = launch.communicate(timeout=120)
        finally:
            ray.shutdown()
    assert launch.returncode == 0, out
    assert not [pid for pid in servers if not _gone(pid)], "a server outlived pdserve launch --ray"
