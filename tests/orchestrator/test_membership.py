"""Dynamic membership (issue 17, section 1): instances join an orchestrator by themselves (`pdserve
serve --join URL --role R`), hold a lease by heartbeat, leave when they drain, and are dropped when
their lease runs out. The leases and routers first on their own, then real worker processes joining
an orchestrator that starts with no instance at all."""

from __future__ import annotations

import asyncio
import re
import secrets
import signal
import ssl
import time

import httpx
import pytest
from harness import (MODEL_NAME, AppThread, Worker, free_port_pair, log_of, run_cli, start_each, start_workers,
                     wait_healthy)

from pdserve.cluster_auth import (PROOF_HEADER, PROOF_NONCE_HEADER, PROOF_TIME_HEADER, PROOF_WINDOW_S, NoncesFull,
                                  ProofRefused, SeenNonces, WrongToken, check_proof, proof, signed_headers)
from pdserve.host import host_id
from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.cluster import LocalCluster
from pdserve.orchestrator.config import DisaggConfig, RouterConfig
from pdserve.orchestrator.coordinator import RemoteCluster, build_coordinator_app
from pdserve.orchestrator.errors import OrchestratorError
from pdserve.orchestrator.membership import Leases, Member
from pdserve.orchestrator.metrics import OrchestratorMetrics
from pdserve.orchestrator.routers import RouteRequest, make_router
from pdserve.testing.wait import wait_until

BODY = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_lives_while_renewed_and_runs_out_after_its_ttl():
    """The built-in store (test_membership_etcd.py holds etcd's to the same)."""
    clock = Clock()
    leases = Leases(3.0, clock)
    assert leases.heartbeat_s == 1.0

    async def scenario():
        await leases.grant("http://a:1", "context")
        await leases.grant("http://b:1", "generation")
        clock.now += 2.5
        assert await leases.renew("http://a:1") and not await leases.renew("http://c:1")  # c never joined
        clock.now += 1.0
        assert await leases.members() == {"http://a:1": Member("context")}  # b ran out
        assert not await leases.renew("http://b:1")  # join again
        assert await leases.describe("http://a:1") == {"joined_s_ago": 3.5, "renewed_s_ago": 1.0, "ttl_s": 3.0}
        assert await leases.release("http://a:1") == "context" and await leases.release("http://a:1") is None
        assert await leases.members() == {}

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="lease_ttl_s"):
        Leases(0)


def _learning_cluster(store=None, hosts: dict[str, str] | None = None) -> tuple[LocalCluster, OrchestratorMetrics]:
    """A LocalCluster whose joins read a made-up /v1/models and /v1/disagg_info (shm, on `hosts[url]`)
    instead of a worker's: what a join reads over HTTP is not what these tests are about."""
    metrics = OrchestratorMetrics()
    cluster = LocalCluster(DisaggConfig(), metrics)
    if store is not None:
        cluster.store = store

    async def learn(url):
        cluster.disagg_info[url] = {"ctx_info_endpoint": "tcp://127.0.0.1:1", "backend": "shm",
                                    "host_id": (hosts or {}).get(url, "host-a/boot")}
        cluster.models[url] = {"data": [{"id": MODEL_NAME}]}

    cluster._learn = learn
    return cluster, metrics


def test_a_sync_while_a_join_waits_for_the_store_does_not_admit_the_instance_a_second_time():
    """The probe loop's sync can run while a join awaits the store (etcd: two calls); it found the new
    member in the store and admitted it as "discovered", and the join then admitted it again as "joined"."""
    granted, go_on = asyncio.Event(), asyncio.Event()

    class SlowStore(Leases):
        async def grant(self, url, role):
            await super().grant(url, role)
            granted.set()
            await go_on.wait()

    async def scenario() -> OrchestratorMetrics:
        cluster, metrics = _learning_cluster(SlowStore(10))
        async with httpx.AsyncClient() as http:
            cluster._http = http
            join = asyncio.ensure_future(cluster.join("context", "http://127.0.0.1:9"))
            await granted.wait()
            await cluster.sync_members()
            go_on.set()
            assert (await join)["status"] == "joined"
        assert cluster.routers["context"].urls == ["http://127.0.0.1:9"]
        return metrics

    events = asyncio.run(scenario()).membership_events
    assert events.labels("context", "joined")._value.get() == 1
    assert events.labels("context", "discovered")._value.get() == 0


def test_an_shm_pair_across_hosts_is_refused_at_the_join():
    """shm needs both roles on one host: a generation instance on another host than the context
    instance is refused before any request, saying to use nixl; a second context instance there is not
    (two instances of one role never transfer between them)."""
    hosts = {"http://127.0.0.1:7": "node-a/1", "http://127.0.0.1:8": "node-b/2", "http://127.0.0.1:9": "node-b/2"}

    async def scenario() -> None:
        cluster, _ = _learning_cluster(hosts=hosts)
        async with httpx.AsyncClient() as http:
            cluster._http = http
            assert (await cluster.join("context", "http://127.0.0.1:7"))["status"] == "joined"
            with pytest.raises(OrchestratorError, match="shm, which needs both roles on one host.*use "
                                                        "cache_transceiver_config.backend nixl") as refused:
                await cluster.join("generation", "http://127.0.0.1:8")
            assert refused.value.status == 409 and "node-b/2" in str(refused.value)
            assert (await cluster.join("context", "http://127.0.0.1:9"))["status"] == "joined"

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", ["round_robin", "load_balancing", "kv_cache_aware", "conversation"])
def test_every_router_takes_instances_that_join_and_forgets_those_that_leave(kind):
    router = make_router(["http://a:1"], RouterConfig(type=kind))
    router.add("http://b:1")
    for url in router.urls:
        router.set_ready(url, True)
    req = RouteRequest(num_tokens=4, session_key="s")
    picked = {router.select(req).url for _ in range(4)}
    assert "http://b:1" in picked or kind == "conversation"  # a conversation keeps its instance
    busy = router.select(req).url
    asyncio.run(router.remove(busy))
    router.finish(busy, req)  # a request that ran on it ends after it left: a no-op
    assert busy not in router.urls and busy not in router.ready
    assert {router.select(req).url for _ in range(3)} == set(router.urls)  # the other one, also for "s"


def _orchestrator(**cfg):
    return AppThread(build_app(DisaggConfig(health_check_interval=0.2, **cfg)))


def _instances(orch, role: str) -> dict[str, dict]:
    return _instances_at(orch.url, role)


def _instances_at(url: str, role: str) -> dict[str, dict]:
    info = httpx.get(url + "/cluster_info", timeout=5).json()
    return {i["url"]: i for i in info[f"{role}_servers"]["instances"]}


def _metric(orch, name: str) -> dict[tuple[str, str], float]:
    """{(role, state or event): value} of one orchestrator metric labelled by role and one more label."""
    out = {}
    for labels, value in re.findall(rf"^{name}{{(.*)}} (\S+)$", httpx.get(orch.url + "/metrics", timeout=5).text, re.M):
        pairs = dict(re.findall(r'(\w+)="(\w*)"', labels))
        role = pairs.pop("role")
        out[role, *pairs.values()] = float(value)
    return out


def test_instances_join_serve_leave_on_drain_and_are_dropped_when_lost(tiny_model_dir, tmp_path_factory):
    """An orchestrator with no instance in its config: a context and a generation instance join, the
    answer equals the aggregated one; the generation instance killed (-9) is dropped within about one
    lease and a new one joins and serves; a joined instance sent SIGTERM leaves at once."""
    ttl = 1.5
    with _orchestrator(lease_ttl_s=ttl) as orch:
        assert httpx.get(orch.url + "/health", timeout=5).status_code == 503  # nothing has joined
        join = {"cache_transceiver_config": {"backend": "shm"}, "join": orch.url}
        workdir = tmp_path_factory.mktemp("membership")
        ctx, gen = start_each(tiny_model_dir, workdir, [{**join, "role": role} for role in ("context", "generation")])
        replacement = None
        try:
            wait_healthy(orch.url)
            expected = httpx.post(gen.url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
            r = httpx.post(orch.url + "/v1/completions", json=BODY, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected
            member = _instances(orch, "generation")[gen.url]
            assert member["state"] == "ready" and member["lease"]["ttl_s"] == ttl
            assert member["disagg_info"]["host_id"] == host_id()  # what an shm pair must share
            assert member["lease"]["renewed_s_ago"] < ttl  # it heartbeats

            killed = time.monotonic()
            gen.stop()  # SIGKILL: no leave, the lease must run out
            assert wait_until(lambda: gen.url not in _instances(orch, "generation"), timeout_s=4 * ttl)
            lost_after = time.monotonic() - killed
            assert lost_after < 2 * ttl + 1, f"dropped {lost_after:.2f} s after the kill, lease {ttl} s"
            assert httpx.get(orch.url + "/health", timeout=5).status_code == 503
            r = httpx.post(orch.url + "/v1/completions", json=BODY, timeout=60)  # says why, not "()"
            assert r.status_code == 503 and "no generation server is in the cluster" in r.text, r.text

            replacement = start_workers(tiny_model_dir, workdir, 1, {**join, "role": "generation"})[0]
            wait_healthy(orch.url)
            r = httpx.post(orch.url + "/v1/completions", json=BODY, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected

            ctx.proc.send_signal(signal.SIGTERM)  # drains: leaves at once, long before its lease would end
            left = time.monotonic()
            assert wait_until(lambda: ctx.url not in _instances(orch, "context"), timeout_s=ttl)
            left_after = time.monotonic() - left
            assert left_after < ttl
            assert ctx.proc.wait(timeout=30) == 0
            events = _metric(orch, "pdserve_orchestrator_membership_events_total")
            assert (events["context", "joined"], events["generation", "joined"]) == (1, 2)
            assert (events["generation", "lost"], events["context", "left"]) == (1, 1)
            assert _metric(orch, "pdserve_orchestrator_instances")["generation", "ready"] == 1
            print(f"lease {ttl} s: killed -9, dropped after {lost_after:.2f} s; SIGTERM, left after {left_after:.2f} s")
        finally:
            for w in (ctx, gen, replacement):
                if w is not None:
                    w.stop()


def test_a_join_is_refused_with_the_reason(workers):
    """A worker without a KV transceiver cannot take disaggregated requests; a bad role or url is a 400;
    one instance cannot hold both roles; a heartbeat from a stranger is a 404 (join again)."""
    plain = workers[0].url
    with _orchestrator(context_servers={"urls": [workers[1].url]}) as orch:
        r = httpx.post(orch.url + "/cluster/join", json={"role": "generation", "url": plain}, timeout=10)
        assert r.status_code == 409 and "no KV transceiver" in r.json()["error"]["message"]
        assert plain not in _instances(orch, "generation")
        r = httpx.post(orch.url + "/cluster/join", json={"role": "generation", "url": workers[1].url}, timeout=10)
        assert r.status_code == 409 and "already a context server" in r.json()["error"]["message"]
        r = httpx.post(orch.url + "/cluster/join", json={"role": "context", "url": workers[1].url}, timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "static"  # listed in the config: no lease
        too_long = "http://" + "a" * 5000 + ":1"
        for body, param in [({"role": "decode", "url": plain}, "role"), ({"role": "context", "url": "x/y"}, "url"),
                            ({"role": "context"}, "url"), ({"role": "context", "url": too_long}, "url")]:
            r = httpx.post(orch.url + "/cluster/join", json=body, timeout=10)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = httpx.post(orch.url + "/cluster/heartbeat", json={"url": plain}, timeout=10)
        assert r.status_code == 404 and "join again" in r.json()["error"]["message"]


def test_an_orchestrator_is_refused_as_a_member_by_name(workers):
    """Another orchestrator's url, joining or listed, is refused, saying what it is. Before, it was
    taken as a generation server (it answers /health and /v1/models as a worker does): the requests
    routed to it failed with a 400 (it sets disaggregated_params itself) while the others were served."""
    ctx = workers[1].url
    with _orchestrator(context_servers={"urls": [ctx]}, generation_servers={"urls": [workers[0].url]}) as other:
        wait_healthy(other.url)
        with _orchestrator(context_servers={"urls": [ctx]}) as orch:
            r = httpx.post(orch.url + "/cluster/join", json={"role": "generation", "url": other.url}, timeout=10)
            assert r.status_code == 409 and "is a pdserve orchestrator, not a worker" in r.text, r.text
            assert other.url not in _instances(orch, "generation")
        with _orchestrator(context_servers={"urls": [ctx]}, generation_servers={"urls": [other.url]}) as orch:
            assert wait_until(lambda: "orchestrator" in _instances(orch, "generation")[other.url]["status"], 5)
            assert _instances(orch, "generation")[other.url]["state"] != "ready"  # never routed to
            assert httpx.get(orch.url + "/health", timeout=5).status_code == 503  # no generation server
    r = httpx.get(workers[1].url + "/v1/disagg_info", timeout=5)  # a worker answers it with its layout
    assert r.status_code == 200


def test_membership_calls_need_the_cluster_token_when_one_is_set(workers):
    with _orchestrator(context_servers={"urls": [workers[1].url]}, cluster_token="t0k") as orch:
        body = {"role": "context", "url": workers[1].url}
        assert httpx.post(orch.url + "/cluster/join", json=body, timeout=10).status_code == 401
        r = httpx.post(orch.url + "/cluster/join", json=body, headers={"X-Cluster-Token": "t0k"}, timeout=10)
        assert r.status_code == 200


def test_instances_join_a_fleet_through_any_of_its_processes(tiny_model_dir, tmp_path_factory, tmp_path):
    """A fleet of two orchestrator processes with no instance in its config (round robin, routed in
    each process): the instances join through the public port, which forwards to the coordinator, and
    both processes route to them after their next sync; a draining instance leaves the fleet at once."""
    port = free_port_pair()
    proc = run_cli(tmp_path, {"port": port, "num_workers": 2, "health_check_interval": 0.3, "lease_ttl_s": 3}, "INFO")
    url = f"http://127.0.0.1:{port}"
    join = {"cache_transceiver_config": {"backend": "shm"}, "join": url}
    workdir = tmp_path_factory.mktemp("fleet-membership")
    ctx = gen = None
    try:
        ctx, gen = start_each(tiny_model_dir, workdir, [{**join, "role": role} for role in ("context", "generation")])
        wait_healthy(url, timeout=30)
        processes = set()
        for _ in range(20):  # a new connection each time: both processes answer
            r = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
            assert r.status_code == 200, r.text
            processes.add(httpx.get(url + "/cluster_info", timeout=10).headers["x-pdserve-process"])
            if len(processes) == 2:
                break
        assert len(processes) == 2, f"all requests hit one process: {processes}"
        gen.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: not _instances_at(url, "generation"), timeout_s=3), log_of(proc)  # it left
        # every process sees that at its next sync with the coordinator (health_check_interval): 8 answers
        # in a row, each on a new connection that either process may take, say 503
        statuses = lambda: [httpx.get(url + "/health", timeout=5).status_code for _ in range(8)]  # noqa: E731
        assert wait_until(lambda: set(statuses()) == {503}, timeout_s=5), \
            httpx.get(url + "/cluster_info", timeout=5).text + log_of(proc)
        assert gen.proc.wait(timeout=30) == 0
    finally:
        for w in (ctx, gen):
            if w is not None:
                w.stop()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_of(proc)


def test_seen_nonces_take_a_nonce_once_within_its_time_and_stay_bounded():
    """The built-in store's replay memory: a nonce is refused again until its proof's time has left the
    window, then forgotten; when full it refuses new nonces rather than forget one still replayable."""
    clock = Clock()
    seen = SeenNonces(max_entries=3, clock=clock)
    assert seen.first_use("a", 10) and not seen.first_use("a", 10)
    assert seen.first_use("b", 5) and seen.first_use("c", 20)
    with pytest.raises(NoncesFull, match="retry in a few seconds"):
        seen.first_use("d", 10)
    clock.now += 5
    assert len(seen) == 2 and seen.first_use("b", 10)  # b's time left the window: forgotten, a new proof may use it
    clock.now += 5.5
    assert not seen.first_use("c", 10) and seen.first_use("a", 10) and len(seen) == 3
    leases = Leases(3.0, clock)
    assert asyncio.run(leases.first_use("n", 60)) and not asyncio.run(leases.first_use("n", 60))


def test_a_proof_is_good_once_and_within_its_window_naming_the_cause():
    token, url = "t0k", "http://127.0.0.1:9"
    headers = signed_headers(token, "leave", url, now=1000.0)
    fresh = check_proof(token, headers, "leave", url, now=1010.0)
    assert fresh.nonce == headers[PROOF_NONCE_HEADER] and fresh.remember_s == PROOF_WINDOW_S - 10
    for now, off in ((1000.0 + PROOF_WINDOW_S + 1, "61 s behind"), (1000.0 - PROOF_WINDOW_S - 1, "61 s ahead of")):
        with pytest.raises(ProofRefused, match=f"time is {off} this orchestrator's clock.*clock skew.*NTP"):
            check_proof(token, headers, "leave", url, now=now)
    for purpose, parts, forged in [("heartbeat", (url,), {}), ("leave", ("http://127.0.0.1:8",), {}),
                                   ("leave", (url,), {PROOF_TIME_HEADER: "1001.000"}),
                                   ("leave", (url,), {PROOF_NONCE_HEADER: "00" * 16})]:
        with pytest.raises(WrongToken):  # another call, url, time or nonce: the proof does not cover it
            check_proof(token, {**headers, **forged}, purpose, *parts, now=1000.0)
    with pytest.raises(WrongToken):
        check_proof("another", headers, "leave", url, now=1000.0)
    with pytest.raises(ProofRefused, match="must carry X-Cluster-Proof-Time and X-Cluster-Proof-Nonce.*same pdserve"):
        check_proof(token, {PROOF_HEADER: proof(token, "leave", url)}, "leave", url)  # the old, replayable form


def _signed(token: str, purpose: str, *parts: str, now: float | None = None) -> dict[str, str]:
    return signed_headers(token, purpose, *parts, now=now)


def test_a_membership_call_replayed_is_refused_as_a_replay(tmp_path):
    """Without any worker: a heartbeat or leave of a url that is no member passes the proof check (404 /
    left false), so its replay shows the check alone: a 401 naming the replay. The same for a join (the
    first attempt fails later, at the challenge of an instance that is not there), and for a proof made
    90 s off the orchestrator's clock (401 naming clock skew). Before, every replay was taken as new."""
    token, url = "t0k", "http://127.0.0.1:9"
    with _orchestrator(cluster_token=token) as orch:
        for path, body, purpose, parts, first in [
                ("/cluster/heartbeat", {"url": url}, "heartbeat", (url,), 404),
                ("/cluster/leave", {"url": url}, "leave", (url,), 200),
                ("/cluster/join", {"role": "generation", "url": url}, "join", ("generation", url), 502)]:
            captured = _signed(token, purpose, *parts)
            r = httpx.post(orch.url + path, json=body, headers=captured, timeout=10)
            assert r.status_code == first, r.text
            for _ in range(2):
                r = httpx.post(orch.url + path, json=body, headers=captured, timeout=10)
                assert r.status_code == 401, r.text
                err = r.json()["error"]
                assert err["code"] == "invalid_cluster_proof" and "a replay" in err["message"], err
            for skew in (-90, 90):
                r = httpx.post(orch.url + path, json=body, headers=_signed(token, purpose, *parts,
                                                                          now=time.time() + skew), timeout=10)
                assert r.status_code == 401 and "clock skew" in r.json()["error"]["message"], r.text
            r = httpx.post(orch.url + path, json=body, headers=_signed("guessed", purpose, *parts), timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_cluster_token", r.text
        r = httpx.post(orch.url + "/cluster/leave", json={"url": url}, headers={"X-Cluster-Token": token}, timeout=10)
        assert r.status_code == 200  # the token itself (an operator) needs no nonce


def test_a_proof_replayed_to_another_process_of_a_fleet_is_refused():
    """A fleet behind SO_REUSEPORT: the replay of a proof one process took may land on another. Both
    ask the coordinator whether the nonce is new, so the second process refuses it."""
    token, url = "t0k", "http://127.0.0.1:9"
    cfg = DisaggConfig(health_check_interval=0.2, cluster_token=token)
    with AppThread(build_coordinator_app(cfg)) as coordinator:
        with AppThread(build_app(cfg, process_id=0, cluster=RemoteCluster(cfg, coordinator.url))) as a, \
                AppThread(build_app(cfg, process_id=1, cluster=RemoteCluster(cfg, coordinator.url))) as b:
            captured = _signed(token, "heartbeat", url)
            r = httpx.post(a.url + "/cluster/heartbeat", json={"url": url}, headers=captured, timeout=10)
            assert r.status_code == 404, r.text  # taken: no such member
            r = httpx.post(b.url + "/cluster/heartbeat", json={"url": url}, headers=captured, timeout=10)
            assert r.status_code == 401 and "a replay" in r.text, r.text
        r = httpx.post(coordinator.url + "/cluster/nonce", json={"nonce": "n", "remember_s": 5}, timeout=10)
        assert r.status_code == 401  # the coordinator's nonce memory is for the fleet's processes only


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 that is its own CA, and its key: (certfile, keyfile)."""
    import datetime
    import ipaddress

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve test cluster")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    certfile, keyfile = tmp_path / "cluster.crt", tmp_path / "cluster.key"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return str(certfile), str(keyfile)


def test_a_cluster_joins_and_serves_over_https(tiny_model_dir, tmp_path):
    """The cluster's HTTP over TLS (docs/deploy.md): an orchestrator and two workers serve https with a
    certificate made here and trust it as their CA; the workers join over https, are routed to at their
    https urls (so the token the orchestrator sends them is encrypted), and a request is served whole."""
    certfile, keyfile = _self_signed(tmp_path)
    tls = {"ssl_certfile": certfile, "ssl_keyfile": keyfile, "ssl_ca_file": certfile}
    token = secrets.token_hex(16)
    port = free_port_pair()
    url = f"https://127.0.0.1:{port}"
    orch = run_cli(tmp_path, {"port": port, "health_check_interval": 0.2, "lease_ttl_s": 3, "cluster_token": token,
                              **tls})
    join = {"cache_transceiver_config": {"backend": "shm", "cluster_token": token}, "join": url, **tls}
    workers = [Worker(tiny_model_dir, tmp_path, {**join, "role": role}) for role in ("context", "generation")]
    client = httpx.Client(verify=ssl.create_default_context(cafile=certfile), timeout=60)
    try:
        def healthy() -> bool:
            assert orch.poll() is None, log_of(orch)
            try:
                return client.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(healthy, 90), log_of(orch) + "".join(w.log_path.read_text()[-1500:] for w in workers)
        info = client.get(url + "/cluster_info", headers={"X-Cluster-Token": token}).json()
        gen_url = f"https://127.0.0.1:{workers[1].port}"
        assert [i["url"] for i in info["generation_servers"]["instances"]] == [gen_url], info
        assert [i["url"] for i in info["context_servers"]["instances"]] == [f"https://127.0.0.1:{workers[0].port}"]
        expected = client.post(gen_url + "/v1/completions", json=BODY).json()["choices"][0]["text"]
        r = client.post(url + "/v1/completions", json=BODY)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on an https port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # nor to one that trusts another CA
            httpx.get(url + "/health", timeout=5)
    finally:
        client.close()
        for w in workers:
            w.stop()
        orch.send_signal(signal.SIGTERM)
        assert orch.wait(timeout=30) in (0, -signal.SIGTERM), log_of(orch)


def test_tls_settings_that_cannot_work_are_refused_naming_the_key(tmp_path):
    from pdserve.config import WorkerConfig

    pem = tmp_path / "c.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    for cls in (WorkerConfig, DisaggConfig):
        with pytest.raises(ValueError, match="ssl_certfile is set and ssl_keyfile is not"):
            cls(ssl_certfile=str(pem))
        with pytest.raises(ValueError, match="ssl_keyfile is set and ssl_certfile is not"):
            cls(ssl_keyfile=str(pem))
        with pytest.raises(ValueError, match="ssl_ca_file '/nowhere/ca.pem' is not a readable file"):
            cls(ssl_ca_file="/nowhere/ca.pem")
        assert cls(ssl_certfile=str(pem), ssl_keyfile=str(pem), ssl_ca_file=str(pem)).ssl_ca_file == str(pem)
