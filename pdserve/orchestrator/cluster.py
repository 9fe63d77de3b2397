"""The instances of both roles: their readiness, what they told us about themselves, and their routers.

`LocalCluster` owns that state in this process: it probes every worker's /health every
health_check_interval, reads /v1/disagg_info and /v1/models once an instance is ready, and routes with
the configured routers. One orchestrator process uses it directly; a fleet's coordinator uses it on
behalf of every orchestrator process (coordinator.py has the remote side, `RemoteCluster`).

Instances are those of the YAML plus the members of the membership store (membership.py): `join`
checks that the instance serves the same model as the rest, over the same KV backend, with a
tokens_per_block the other role's instances can re-cut, and refuses it with the reason otherwise.
Every probe round the routers are synced with the store: a member whose lease ran out is dropped,
one that left is dropped, and one that joined through another orchestrator process (etcd) is added.
With a cluster_token, every instance (joined or of the YAML) proves it holds the token when its
/v1/disagg_info is read (cluster_auth.py) before it is routed to; one that cannot is never ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import httpx

from pdserve.cluster_auth import NONCE_HEADER, new_nonce, proof_ok
from pdserve.orchestrator.config import DisaggConfig
from pdserve.orchestrator.errors import NO_READY_INSTANCE, NOT_A_WORKER, OrchestratorError
from pdserve.orchestrator.kv_cache_aware import KvCacheAwareRouter
from pdserve.orchestrator.membership import Leases, MemberStore, StoreUnavailable
from pdserve.orchestrator.metrics import OrchestratorMetrics
from pdserve.orchestrator.routers import NoReadyInstance, Route, RouteRequest, Router, make_router

log = logging.getLogger(__name__)

ROLES = ("context", "generation")
_PROBE_TIMEOUT_S = 2.0
# Probes in a row that must time out before a ready worker is taken out of routing. A busy worker can
# miss one 2 s probe (a CI run on two cores once saw it, with several instances' ranks on the machine),
# and taking out a context server for one slow answer fails every request meanwhile; a worker that is
# gone refuses the connection instead, and that counts at once.
_TIMEOUTS_BEFORE_UNREADY = 2


STATES = ("joining", "ready", "draining", "unready")


class NotAWorker(Exception):
    """The instance at a member's url is a pdserve orchestrator (this one, or another)."""


class NoProof(Exception):
    """The instance at a member's url did not prove that it holds this orchestrator's cluster_token, or
    holds one where this orchestrator has none."""


class LocalCluster:
    def __init__(self, cfg: DisaggConfig, metrics: OrchestratorMetrics | None = None):
        self.cfg = cfg
        self.metrics = metrics
        self.routers: dict[str, Router] = {
            "context": make_router(cfg.context_servers.urls, cfg.context_servers.router),
            "generation": make_router(cfg.generation_servers.urls, cfg.generation_servers.router)}
        self.disagg_info: dict[str, dict | None] = {}  # url -> /v1/disagg_info (None: the worker has none)
        self.models: dict[str, dict] = {}  # url -> its /v1/models answer
        self.status: dict[str, str] = {u: "starting" for r in self.routers.values() for u in r.urls}
        self._timeouts: dict[str, int] = {}  # url -> probes in a row that timed out
        self.store = _member_store(cfg)
        self.joined: dict[str, str] = {}  # url -> role of the members in the routers (not those of the YAML)
        self._joining: set[str] = set()  # joins under way here: a sync meanwhile must not admit them too
        self._store_problem: str | None = None
        self._task: asyncio.Task | None = None
        self._http: httpx.AsyncClient | None = None
        self.started_at = time.monotonic()

    async def start(self, http: httpx.AsyncClient) -> None:
        self._http = http
        for router in self.routers.values():
            await router.start(http)
        await self.sync_members()  # those the store already has: an orchestrator that restarted, a fleet
        await self.probe_all()
        self._task = asyncio.ensure_future(self._probe_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for router in self.routers.values():
            await router.close()
        await self.store.close()

    async def _probe_loop(self) -> None:
        # Often enough that a lost member is dropped within about one lease.
        interval = min(self.cfg.health_check_interval, self.store.heartbeat_s)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sync_members()
            except StoreUnavailable as e:  # keep routing to the members as last seen
                self._store_trouble(e)
            except Exception:  # a bug here must not stop the probing for good
                log.exception("membership sync failed")
            try:
                await self.probe_all()
            except Exception:
                log.exception("health probe round failed")

    def _store_trouble(self, e: StoreUnavailable) -> None:
        """Log a store outage once, not every round."""
        if str(e) != self._store_problem:
            log.warning("%s; routing to the members as last seen", e)
            self._store_problem = str(e)

    async def probe_all(self) -> None:
        pairs = [(role, url) for role, r in self.routers.items() for url in r.urls]
        await asyncio.gather(*(self._probe(role, url) for role, url in pairs))
        self._publish()

    def state(self, role: str, url: str) -> str:
        """joining (admitted, not yet ready) | ready | draining (shutting down) | unready"""
        if url in self.routers[role].ready:
            return "ready"
        status = self.status.get(url)
        if status in ("joining", "starting"):
            return "joining"
        return "draining" if status == "draining" else "unready"

    def _publish(self, event: str | None = None, role: str | None = None) -> None:
        """Instances by role and state, and a membership event, into /metrics."""
        if self.metrics is None:
            return
        if event is not None:
            self.metrics.membership_events.labels(role, event).inc()
        for r, router in self.routers.items():
            counts = dict.fromkeys(STATES, 0)
            for url in router.urls:
                counts[self.state(r, url)] += 1
            for state, n in counts.items():
                self.metrics.instances.labels(r, state).set(n)

    async def _probe(self, role: str, url: str, learned: bool = False) -> None:
        """`learned`: /v1/models and /v1/disagg_info were just read (a join), so a ready answer needs no re-read."""
        router = self.routers[role]
        try:
            r = await self._http.get(url + "/health", timeout=_PROBE_TIMEOUT_S)
            ok = r.status_code == 200
            reason = "ready" if ok else f"/health answered {r.status_code}"
            if _error_code(r) == "draining":
                reason = "draining"
            if ok and url not in router.ready and not learned:  # (re)joining: it may have restarted with another config
                await self._learn(url)
        except (NotAWorker, NoProof) as e:  # never ready; said once, not at every probe
            ok, reason = False, str(e)
            if self.status.get(url) != reason:
                log.error("%s server %s: %s", role, url, reason)
        except httpx.HTTPError as e:
            ok, reason = False, f"{type(e).__name__}: {e or 'no answer'}"
            timed_out = isinstance(e, httpx.TimeoutException)
            self._timeouts[url] = self._timeouts.get(url, 0) + 1 if timed_out else 0
            if timed_out and url in router.ready and self._timeouts[url] < _TIMEOUTS_BEFORE_UNREADY:
                log.warning("%s server %s did not answer /health within %g s; still routed to until %d probes "
                            "in a row time out", role, url, _PROBE_TIMEOUT_S, _TIMEOUTS_BEFORE_UNREADY)
                return
        else:
            self._timeouts[url] = 0
        if ok != (url in router.ready):
            log.info("%s server %s is %s", role, url, "ready" if ok else f"not ready ({reason})")
            if not ok and reason != "draining":
                self._failed(role)
        if ok and isinstance(router, KvCacheAwareRouter):
            info = self.disagg_info.get(url) or {}
            if info.get("tokens_per_block"):
                router.attach_events(url, info.get("kv_events_endpoint"), int(info["tokens_per_block"]))
        self.status[url] = reason
        router.set_ready(url, ok)

    async def _learn(self, url: str) -> None:
        """Read the instance's /v1/models and /v1/disagg_info; NotAWorker when it is an orchestrator, NoProof
        when this orchestrator has a cluster_token and the instance did not answer its challenge with it."""
        models = await self._http.get(url + "/v1/models", timeout=_PROBE_TIMEOUT_S)
        models.raise_for_status()
        nonce = new_nonce()
        info = await self._http.get(url + "/v1/disagg_info", timeout=_PROBE_TIMEOUT_S, headers={NONCE_HEADER: nonce})
        if info.status_code == 404 and _error_code(info) == NOT_A_WORKER:
            raise NotAWorker(f"{url} is a pdserve orchestrator, not a worker: list the workers' urls instead")
        # A worker without the endpoint (404) can still serve conditional (local) requests.
        try:
            disagg_info = info.json() if info.status_code == 200 else None
        except ValueError:
            disagg_info = None
        proof = disagg_info.pop("cluster_proof", None) if isinstance(disagg_info, dict) else None
        holds = disagg_info.pop("holds_cluster_token", False) if isinstance(disagg_info, dict) else False
        token = self.cfg.cluster_token
        if token is None and holds:  # it would refuse every disaggregated request this orchestrator sends
            raise NoProof(f"{url} has a cluster_token and this orchestrator has none: set the orchestrator's "
                          "cluster_token to the workers' cache_transceiver_config.cluster_token")
        if token is not None and not proof_ok(token, proof if isinstance(proof, str) else None, "member", nonce):
            raise NoProof(f"{url} did not prove that it holds this orchestrator's cluster_token (it answered "
                          f"/v1/disagg_info {'with another proof' if proof else 'without one'}): set its "
                          "cache_transceiver_config.cluster_token to the orchestrator's cluster_token")
        self.disagg_info[url] = disagg_info
        self.models[url] = models.json()

    # -- membership (membership.py) -----------------------------------------------------------------

    def role_of(self, url: str) -> str | None:
        return next((role for role, r in self.routers.items() if url in r.urls), None)

    async def join(self, role: str, url: str) -> dict[str, Any]:
        """Admit `url` as a `role` instance, or refuse it (409) saying why. Joining again renews."""
        held = self.role_of(url)
        if held is not None and held != role:
            raise OrchestratorError(409, f"{url} is already a {held} server of this cluster; an instance has one "
                                         "role", "role_conflict", "role")
        if held is not None and url not in self.joined:
            return {"status": "static", "lease_ttl_s": None, "heartbeat_s": None}
        if held is None:
            try:
                await self._learn(url)
            except NotAWorker as e:
                raise OrchestratorError(409, f"{url} cannot join as a {role} server: {e}", "incompatible_instance",
                                        "url") from None
            except NoProof as e:
                log.warning("refused %s server %s: %s", role, url, e)
                self._publish("refused", role)
                raise OrchestratorError(403, f"{url} cannot join as a {role} server: {e}", "invalid_cluster_token",
                                        "url") from None
            except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:
                raise OrchestratorError(502, f"cannot read /v1/models and /v1/disagg_info of {url} ({e}): is it a "
                                             "pdserve worker reachable from the orchestrator at that url?",
                                        "join_unreachable", "url") from None
            why = self._incompatible(role, url)
            if why is not None:
                self._forget(url)
                log.warning("refused %s server %s: %s", role, url, why)
                self._publish("refused", role)
                raise OrchestratorError(409, f"{url} cannot join as a {role} server: {why}", "incompatible_instance")
        self._joining.add(url)
        try:
            with _store_errors():
                await self.store.grant(url, role)
            if held is None:
                log.info("%s server %s joined (lease %g s)", role, url, self.store.ttl_s)
                await self._admit(url, role, "joined", learned=True)
        finally:
            self._joining.discard(url)
        return {"status": "joined", "lease_ttl_s": self.store.ttl_s, "heartbeat_s": self.store.heartbeat_s}

    async def _admit(self, url: str, role: str, event: str, learned: bool = False) -> None:
        self.routers[role].add(url)
        self.joined[url] = role
        self.status[url] = "joining"
        await self._probe(role, url, learned=learned)
        self._publish(event, role)

    async def heartbeat(self, url: str) -> dict[str, Any]:
        with _store_errors():
            renewed = await self.store.renew(url)
        if not renewed:
            raise OrchestratorError(404, f"{url} is not a member of this cluster (its lease ran out, or the "
                                         "orchestrator restarted): join again", "not_a_member", "url")
        return {"status": "ok"}

    async def leave(self, url: str) -> bool:
        """Take a joined instance out of routing now; False when it was not a joined member."""
        with _store_errors():
            role = await self.store.release(url)
        if role is None:
            return False
        log.info("%s server %s left", role, url)
        if url in self.joined:
            await self._drop(url, self.joined[url], "left")
        return True

    async def first_use(self, nonce: str, remember_s: float) -> bool:
        """False when a member's proof with this nonce was taken already (a replay, cluster_auth.py)."""
        with _store_errors():
            return await self.store.first_use(nonce, remember_s)

    async def sync_members(self) -> None:
        """Routers := the YAML's instances + the store's members (StoreUnavailable: nothing changes)."""
        members = await self.store.members()
        self._store_problem = None
        for url, role in list(self.joined.items()):
            member = members.get(url)
            if member is not None and member.role == role and not member.left:
                continue
            if member is not None and member.left:
                log.info("%s server %s left", role, url)
                await self._drop(url, role, "left")
            else:
                log.warning("%s server %s is lost: no heartbeat for %g s; dropped from routing", role, url,
                            self.store.ttl_s)
                await self._drop(url, role, "lost")
        for url, member in members.items():
            if not member.left and self.role_of(url) is None and url not in self._joining:
                # joined through another orchestrator process, or before this one restarted
                log.info("%s server %s is a member (lease %g s)", member.role, url, self.store.ttl_s)
                await self._admit(url, member.role, "discovered")

    async def _drop(self, url: str, role: str, event: str) -> None:
        await self.routers[role].remove(url)
        self.joined.pop(url, None)
        self._forget(url)
        self._publish(event, role)

    def _forget(self, url: str) -> None:
        for table in (self.status, self.disagg_info, self.models, self._timeouts):
            table.pop(url, None)

    def _incompatible(self, role: str, url: str) -> str | None:
        """Why `url` (just learned) cannot serve beside the instances already known, or None."""
        info = self.disagg_info.get(url)
        if info is None or not info.get("ctx_info_endpoint"):
            return ("it has no KV transceiver (/v1/disagg_info says none): set cache_transceiver_config.backend "
                    "in its config")
        model = _model_id(self.models.get(url))
        for other, other_info in self.disagg_info.items():
            if other == url or other_info is None or other not in self.models:
                continue
            if _model_id(self.models[other]) != model:
                return f"it serves {model!r} and {other} serves {_model_id(self.models[other])!r}"
            if other_info.get("backend") != info.get("backend"):
                return (f"its KV backend is {info.get('backend')!r} and {other}'s is {other_info.get('backend')!r}; "
                        "both roles must use the same cache_transceiver_config.backend")
            tpb, other_tpb = int(info.get("tokens_per_block") or 0), int(other_info.get("tokens_per_block") or 0)
            crosses = self.role_of(other) not in (role, None)
            host, other_host = info.get("host_id"), other_info.get("host_id")
            if crosses and info.get("backend") == "shm" and host and other_host and host != other_host:
                return (f"its KV backend is shm, which needs both roles on one host, and it runs on {host} while "
                        f"{other} runs on {other_host}: use cache_transceiver_config.backend nixl across hosts")
            if crosses and tpb and other_tpb and max(tpb, other_tpb) % min(tpb, other_tpb):
                return (f"its tokens_per_block {tpb} and {other}'s {other_tpb} do not divide one another, so their KV "
                        "cannot be re-cut between them")
        return None

    def mark_unreachable(self, role: str, url: str, reason: str) -> None:
        router = self.routers[role]
        if url in router.urls:  # not one that has left since
            if url in router.ready:
                self._failed(role)
            router.set_ready(url, False)
            self.status[url] = reason

    def _failed(self, role: str) -> None:
        """A ready instance of `role` stopped serving (not by draining): counted once, when it leaves routing."""
        if self.metrics is not None:
            self.metrics.instance_failures.labels(role).inc()

    def _no_ready(self, role: str) -> OrchestratorError:
        urls = self.routers[role].urls
        if not urls:  # the last one left or was dropped, or none has joined yet
            return OrchestratorError(503, f"no {role} server is in the cluster: start one, or wait for a restarted "
                                     "one to join", NO_READY_INSTANCE)
        why = "; ".join(f"{u}: {self.status.get(u, 'starting')}" for u in urls)
        return OrchestratorError(503, f"no ready {role} server ({why})", NO_READY_INSTANCE)

    # -- the routing interface the orchestrator uses (RemoteCluster has the same) --------------------

    async def select(self, role: str, req: RouteRequest) -> Route:
        try:
            return self.routers[role].select(req)
        except NoReadyInstance:
            raise self._no_ready(role) from None

    async def finish(self, role: str, url: str, req: RouteRequest) -> None:
        self.routers[role].finish(url, req)

    async def unreachable(self, role: str, url: str, reason: str) -> None:
        self.mark_unreachable(role, url, reason)

    def ready_urls(self, role: str) -> list[str]:
        router = self.routers[role]
        return [u for u in router.urls if u in router.ready]

    def needs_tokens(self, role: str) -> bool:
        rc = self.routers[role].config
        return rc.type == "kv_cache_aware" or (rc.type == "load_balancing" and rc.option("metric") == "tokens")

    def model_list(self) -> dict | None:
        for url in self.ready_urls("generation") + self.ready_urls("context"):
            if url in self.models:
                return self.models[url]
        return None

    def roles_below_minimum(self) -> list[str]:
        """The roles with fewer ready instances than their minimal_instances (empty: ready to serve)."""
        minimal = self.cfg.minimal_instances
        return [role for role in self.routers if len(self.ready_urls(role)) < minimal[role]]

    async def cluster_info(self) -> dict[str, Any]:
        async def role_info(role: str) -> dict:
            snap = self.routers[role].snapshot()
            snap["minimal_instances"] = self.cfg.minimal_instances[role]
            for inst in snap["instances"]:
                inst["state"] = self.state(role, inst["url"])
                inst["status"] = self.status.get(inst["url"])
                inst["disagg_info"] = self.disagg_info.get(inst["url"])
                inst["lease"] = await self.store.describe(inst["url"]) if inst["url"] in self.joined else None
            return snap

        return {"schedule_style": self.cfg.schedule_style,
                "conditional_disagg": self.cfg.conditional_disagg.model_dump() if self.cfg.conditional_disagg else None,
                "context_servers": await role_info("context"), "generation_servers": await role_info("generation"),
                "models": self.model_list(), "uptime_s": round(time.monotonic() - self.started_at, 3)}


def _member_store(cfg: DisaggConfig) -> MemberStore:
    """The store `cluster_storage` names: unset for the built-in one, or an etcd:// url."""
    if cfg.cluster_storage is None:
        return Leases(cfg.lease_ttl_s)
    from pdserve.orchestrator.etcd_store import EtcdStore

    return EtcdStore(cfg.cluster_storage, cfg.lease_ttl_s)


@contextlib.contextmanager
def _store_errors():
    """The store down: a 503 that says which store, to the instance that called."""
    try:
        yield
    except StoreUnavailable as e:
        raise OrchestratorError(503, str(e), "store_unavailable") from None


def _model_id(listing: dict | None) -> str | None:
    try:
        return listing["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        return None


def _error_code(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
