"""This worker's membership in an orchestrator's cluster (`join` + `role`; the orchestrator's side is
pdserve/orchestrator/membership.py).

    own /health answers 200 ──> POST {join}/cluster/join {role, url}
                                  every heartbeat_s (the orchestrator's answer): POST /cluster/heartbeat
                                  404 (lease lost, orchestrator restarted) ──> join again
    drain or shutdown ────────> POST /cluster/leave, then no more heartbeats

A refusal (409: another model, another KV backend, a role clash; 401/403: the cluster token) is logged
with the orchestrator's reason and retried every `_RETRY_S`, so an operator who fixes the other side
sees the instance join without restarting it. With a cluster_token, each call carries an HMAC of it
over the call, this instance's url, the time and a fresh nonce (X-Cluster-Proof, pdserve/cluster_auth.py),
never the token itself: an orchestrator at a wrong --join url learns nothing it can use, and a call
captured on the wire is refused when replayed. Runs on its own thread with a plain httpx client: the
server's event loop never waits on the orchestrator.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import httpx

from pdserve.cluster_auth import signed_headers
from pdserve.config import WorkerConfig
from pdserve.tls import client_verify

log = logging.getLogger(__name__)

_RETRY_S = 2.0  # between attempts to join while the orchestrator is unreachable or refuses
_TIMEOUT_S = 5.0
_OWN_HEALTH_TIMEOUT_S = 600.0


class ClusterMember:
    def __init__(self, cfg: WorkerConfig, own_url: str, draining: Callable[[], bool]):
        assert cfg.join is not None and cfg.role is not None
        self.orchestrator, self.role = cfg.join, cfg.role
        self.url = cfg.advertise_url or own_url
        self._own_url, self._draining = own_url, draining
        self._token = cfg.cache_transceiver_config.cluster_token
        self._verify = client_verify(cfg.ssl_ca_file)  # for an https orchestrator
        self._bearer = {"Authorization": f"Bearer {cfg.join_token}"} if cfg.join_token else {}
        self._stop = threading.Event()
        self._joined = False
        self._heartbeat_s = _RETRY_S
        self._last_problem: str | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-join", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Leave (when joined) and end the thread; called once the server stops."""
        self._stop.set()
        self._thread.join(timeout=_TIMEOUT_S + 1)
        self._leave()

    def _run(self) -> None:
        with httpx.Client(timeout=_TIMEOUT_S, trust_env=False, verify=self._verify) as self._http:
            if not self._wait_own_health():
                return
            while not self._stop.is_set() and not self._draining():
                if self._joined:
                    self._heartbeat()
                elif self._join() == "static":
                    return  # listed in the orchestrator's config: no lease to keep
                next_at = time.monotonic() + (self._heartbeat_s if self._joined else _RETRY_S)
                while not self._stop.is_set() and time.monotonic() < next_at:
                    if self._draining():
                        break
                    self._stop.wait(0.1)
            if self._draining():
                self._leave()  # out of routing now, not when the lease runs out; no join while draining

    def _wait_own_health(self) -> bool:
        """The orchestrator probes this instance as soon as it joins: be serving first."""
        deadline = time.monotonic() + _OWN_HEALTH_TIMEOUT_S
        # our own https may have a certificate for another name than the loopback: it is this process,
        # and /health carries nothing secret, so it is not verified
        with httpx.Client(timeout=_TIMEOUT_S, trust_env=False, verify=False) as own:
            while not self._stop.is_set() and time.monotonic() < deadline:
                try:
                    if own.get(self._own_url + "/health").status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                self._stop.wait(0.1)
        return False

    def _join(self) -> str | None:
        """Ask to join; the orchestrator's status ("joined", "static"), or None when it did not take us."""
        answer = self._post("/cluster/join", {"role": self.role, "url": self.url}, ("join", self.role, self.url))
        if answer is None:
            return None
        self._last_problem = None
        if answer.get("status") == "static":
            log.info("the orchestrator at %s lists %s in its config; no need to join", self.orchestrator, self.url)
            return "static"
        self._joined = True
        self._heartbeat_s = float(answer.get("heartbeat_s") or _RETRY_S)
        log.info("joined the cluster at %s as a %s server (%s); heartbeat every %g s", self.orchestrator, self.role,
                 self.url, self._heartbeat_s)
        return "joined"

    def _heartbeat(self) -> None:
        if self._post("/cluster/heartbeat", {"url": self.url}, ("heartbeat", self.url), not_a_member_ok=True) is None:
            self._joined = False

    def _leave(self) -> None:
        if not self._joined:
            return
        self._joined = False
        try:
            with httpx.Client(timeout=_TIMEOUT_S, trust_env=False, verify=self._verify) as http:
                http.post(self.orchestrator + "/cluster/leave", json={"url": self.url},
                          headers=self._headers("leave", self.url))
            log.info("left the cluster at %s", self.orchestrator)
        except httpx.HTTPError as e:
            log.warning("could not tell the orchestrator at %s that this instance leaves (%s); its lease runs out",
                        self.orchestrator, e)

    def _headers(self, purpose: str, *parts: str) -> dict[str, str]:
        signed = signed_headers(self._token, purpose, *parts) if self._token else {}
        return {**self._bearer, **signed}

    def _post(self, path: str, body: dict, signed: tuple[str, ...], not_a_member_ok: bool = False) -> dict | None:
        try:
            r = self._http.post(self.orchestrator + path, json=body, headers=self._headers(*signed))
        except httpx.HTTPError as e:
            self._problem(f"the orchestrator at {self.orchestrator} is unreachable ({type(e).__name__}: {e}); "
                          "retrying")
            return None
        if r.status_code == 200:
            return r.json()
        if r.status_code == 404 and not_a_member_ok:
            log.warning("the orchestrator at %s no longer counts this instance as a member; joining again",
                        self.orchestrator)
            return None
        try:
            why = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = r.text[:200]
        self._problem(f"the orchestrator at {self.orchestrator} refused {path} ({r.status_code}): {why}; retrying")
        return None

    def _problem(self, message: str) -> None:
        """Log a problem once, not at every retry."""
        if message != self._last_problem:
            log.warning("%s", message)
            self._last_problem = message
