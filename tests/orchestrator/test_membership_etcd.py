"""The membership in a real etcd (`cluster_storage: etcd://...`, issue 17 section 1): the store on its own,
an orchestrator that cannot reach it, and real workers whose membership outlives an orchestrator killed
with -9 and is read by a fleet that has no coordinator."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
from harness import MODEL_NAME, AppThread, free_port_pair, log_of, run_cli, start_each, wait_healthy

from pdserve.cluster_auth import signed_headers
from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.config import DisaggConfig
from pdserve.orchestrator.etcd_store import EtcdStore, parse_etcd_url
from pdserve.orchestrator.membership import Member, StoreUnavailable
from pdserve.testing.etcd import EtcdMissing, EtcdServer
from pdserve.testing.wait import wait_until

BODY = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    try:
        server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    except EtcdMissing as e:
        pytest.skip(str(e))
    yield server
    server.stop()


def test_cluster_storage_urls_are_checked():
    assert parse_etcd_url("etcd://10.0.0.1:2379,10.0.0.2/team-a/") == ([("10.0.0.1", 2379), ("10.0.0.2", 2379)],
                                                                      "/team-a")
    assert parse_etcd_url("etcd://[::1]:2380") == ([("::1", 2380)], "/pdserve")
    for bad, why in [("http://127.0.0.1:2379", "must be an etcd url"), ("etcd://h:port", "is not host:port"),
                     ("etcd://h:0", "is not host:port"), ("etcd://", "is not host:port")]:
        with pytest.raises(ValueError, match=why):
            DisaggConfig(cluster_storage=bad)
    with pytest.raises(ValueError, match="drop disagg_coordinator_url"):
        DisaggConfig(cluster_storage="etcd://h:1", disagg_coordinator_url="http://h:2")
    fleet = DisaggConfig(cluster_storage="etcd://h:1", num_workers=2, port=1)  # no coordinator on port-1
    assert not fleet.uses_coordinator


def test_etcd_keeps_leases_as_the_built_in_store_does_and_every_reader_sees_them(etcd):
    """Two stores over one etcd stand for two orchestrator processes: what one grants the other reads; a
    leave through one is seen as a leave by the other; etcd itself ends a lease nobody renews."""

    async def scenario():
        a, b = EtcdStore(etcd.storage + "/store-test", 1.5), EtcdStore(etcd.storage + "/store-test", 1.5)
        try:
            await a.grant("http://ctx:1", "context")
            await a.grant("http://gen:1", "generation")
            assert a.ttl_s >= 2  # rounded up to whole seconds and to etcd's minimum
            assert await b.members() == {"http://ctx:1": Member("context"), "http://gen:1": Member("generation")}
            assert await b.renew("http://ctx:1") and not await b.renew("http://stranger:1")
            lease = await b.describe("http://gen:1")
            assert lease["store"] == "etcd" and lease["ttl_s"] == a.ttl_s and lease["joined_s_ago"] < 5
            assert await b.release("http://ctx:1") == "context"
            assert (await a.members())["http://ctx:1"] == Member("context", left=True)
            assert not await a.renew("http://ctx:1") and await a.release("http://ctx:1") is None

            async def gone() -> float:
                start = time.monotonic()
                while await a.members():  # gen is not renewed, ctx left: etcd ends both leases
                    assert time.monotonic() - start < 3 * a.ttl_s, await a.members()
                    await asyncio.sleep(0.1)
                return time.monotonic() - start

            print(f"unrenewed lease of {a.ttl_s:g} s ended by etcd after {await gone():.2f} s")
            assert not await a.renew("http://gen:1")
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_a_proofs_nonce_is_taken_once_by_every_orchestrator_over_one_etcd(etcd):
    """Two stores over one etcd stand for two orchestrator processes (a fleet with no coordinator behind
    SO_REUSEPORT, or one restarted): a member proof's nonce that one took is a replay to the other, and
    etcd forgets it once its lease (at least the proof's window) ends."""

    async def scenario():
        a, b = EtcdStore(etcd.storage + "/nonce-test", 3), EtcdStore(etcd.storage + "/nonce-test", 3)
        try:
            assert await a.first_use("n1", 1.0) and not await b.first_use("n1", 1.0)
            assert not await a.first_use("n1", 1.0) and await b.first_use("n2", 1.0)
            assert await a.members() == {}  # nonces are not members

            async def forgotten() -> float:
                start = time.monotonic()
                while not await a.first_use("n1", 1.0):
                    assert time.monotonic() - start < 10, "etcd kept a nonce long after its lease"
                    await asyncio.sleep(0.2)
                return time.monotonic() - start

            print(f"a nonce remembered for 1 s forgotten by etcd after {await forgotten():.2f} s")
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())
    token, url = "t0k", "http://127.0.0.1:9"
    cfg = DisaggConfig(health_check_interval=0.2, cluster_token=token, cluster_storage=etcd.storage + "/nonce-app")
    with AppThread(build_app(cfg, process_id=0)) as a, AppThread(build_app(cfg, process_id=1)) as b:
        captured = signed_headers(token, "leave", url)
        r = httpx.post(a.url + "/cluster/leave", json={"url": url}, headers=captured, timeout=10)
        assert r.status_code == 200 and r.json() == {"left": False}, r.text
        r = httpx.post(b.url + "/cluster/leave", json={"url": url}, headers=captured, timeout=10)
        assert r.status_code == 401 and "a replay" in r.text, r.text


def test_an_unreachable_etcd_is_a_clear_error(tmp_path):
    async def down():
        store = EtcdStore(f"etcd://127.0.0.1:{free_port_pair()},127.0.0.1:{free_port_pair()}", 3)
        try:
            with pytest.raises(StoreUnavailable, match="did not answer .*is etcd running there"):
                await store.members()
        finally:
            await store.close()

    asyncio.run(down())
    storage = f"etcd://127.0.0.1:{free_port_pair()}"
    proc = run_cli(tmp_path, {"port": free_port_pair(), "cluster_storage": storage, "server_start_timeout": 1})
    assert proc.wait(timeout=30) == 1
    assert f"the membership store {storage} did not answer" in log_of(proc)


def _instances(url: str, role: str) -> dict:
    info = httpx.get(url + "/cluster_info", timeout=10).json()
    return {i["url"]: i for i in info[f"{role}_servers"]["instances"]}


def _events(url: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve_orchestrator_membership_events_total{"):
            labels, value = line[line.index("{") + 1:].split("} ")
            pairs = dict(p.split("=") for p in labels.split(","))
            out[pairs["role"].strip('"'), pairs["event"].strip('"')] = float(value)
    return out


def test_the_membership_outlives_an_orchestrator_killed_and_a_fleet_reads_it_without_a_coordinator(
        etcd, tiny_model_dir, tmp_path_factory):
    """Workers join orchestrator A, whose members are in etcd. A is killed with -9 and started again: it
    serves at once from etcd, with no join. A fleet B of two processes over the same etcd routes to the
    same workers from both processes, though no worker joined B and B has no coordinator; a worker that
    drains leaves through A and B drops it too. The context side is routed kv_cache_aware: the restarted A
    has the context instance's block index back (from the instance's snapshot), not an empty one."""
    common = {"cluster_storage": etcd.storage + "/outlive", "lease_ttl_s": 3, "health_check_interval": 0.3,
              "context_servers": {"router": {"type": "kv_cache_aware"}}}
    port = free_port_pair()
    url = f"http://127.0.0.1:{port}"
    tmp = tmp_path_factory.mktemp("etcd-orch")
    (tmp / "a1").mkdir(), (tmp / "a2").mkdir(), (tmp / "b").mkdir()
    orch = run_cli(tmp / "a1", {**common, "port": port}, "INFO")
    join = {"cache_transceiver_config": {"backend": "shm"}, "join": url}
    ctx = gen = fleet = None
    try:
        ctx, gen = start_each(tiny_model_dir, tmp, [{**join, "role": role, "kv_events_port": 0}
                                                    for role in ("context", "generation")])
        wait_healthy(url, timeout=30)
        expected = httpx.post(gen.url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
        cached = lambda: _instances(url, "context")[ctx.url]["cached_blocks"]  # noqa: E731
        assert wait_until(lambda: cached() > 0, timeout_s=10)
        blocks = cached()

        orch.kill()  # -9: no clean shutdown; the members stay in etcd while their leases live
        orch.wait(timeout=10)
        restarted = time.monotonic()
        orch = run_cli(tmp / "a2", {**common, "port": port}, "INFO")
        wait_healthy(url, timeout=30)
        healthy_after = time.monotonic() - restarted
        # the index is back before any request could have refilled it (a repeat is a prefix-cache hit anyway)
        assert wait_until(lambda: cached() == blocks, timeout_s=10), (cached(), blocks)
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
        served_after = time.monotonic() - restarted
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text + log_of(orch)
        events = _events(url)
        assert (events["context", "discovered"], events["generation", "discovered"]) == (1, 1), events
        assert events["context", "joined"] == events["generation", "joined"] == 0  # nobody had to join again
        print(f"orchestrator killed -9 and restarted: /health 200 after {healthy_after:.2f} s, first answer "
              f"after {served_after:.2f} s (python start included)")

        fleet_port = free_port_pair()
        fleet_url = f"http://127.0.0.1:{fleet_port}"
        fleet = run_cli(tmp / "b", {**common, "port": fleet_port, "num_workers": 2}, "INFO")
        wait_healthy(fleet_url, timeout=30)
        processes = set()
        for _ in range(20):  # a new connection each time: both processes answer
            r = httpx.post(fleet_url + "/v1/completions", json=BODY, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
            processes.add(httpx.get(fleet_url + "/cluster_info", timeout=10).headers["x-pdserve-process"])
            if len(processes) == 2:
                break
        assert len(processes) == 2, f"all requests hit one process: {processes}"
        assert "coordinator" not in httpx.get(fleet_url + "/cluster_info", timeout=10).json()
        with pytest.raises(httpx.ConnectError):  # nothing listens on port-1
            httpx.get(f"http://127.0.0.1:{fleet_port - 1}/health", timeout=2)

        gen.proc.send_signal(signal.SIGTERM)  # drains, leaves through A; B sees the leave in etcd
        statuses = lambda: [httpx.get(fleet_url + "/health", timeout=5).status_code for _ in range(8)]  # noqa: E731
        assert wait_until(lambda: set(statuses()) == {503}, timeout_s=3), log_of(fleet)
        assert gen.url not in _instances(url, "generation")
        assert gen.proc.wait(timeout=30) == 0
    finally:
        for w in (ctx, gen):
            if w is not None:
                w.stop()
        for p in (orch, fleet):
            if p is not None:
                p.send_signal(signal.SIGTERM)
        # uvicorn re-raises the SIGTERM it handled once it has shut down; the fleet's supervisor exits 0
        assert orch.wait(timeout=30) in (0, -signal.SIGTERM), log_of(orch)
        assert fleet is None or fleet.wait(timeout=30) == 0, log_of(fleet)
