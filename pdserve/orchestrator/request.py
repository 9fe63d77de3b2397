"""One client request in the orchestrator, and what it holds on the cluster while it runs.

A request holds at most one route reservation per role (the instance's load counted for routing, until
`finish`) and, once a context instance answered it, that instance's copy of its KV, until the generation
side pulls it. Whatever the path out of the request flow (an answer, a client that left, a lost
instance, a retry under a fresh id), `let_go` gives back what is still held: the routes are finished and
unpulled KV is released on its context instance. The flow calls it in one `finally` and before each retry,
so no failure path has to remember what to free.

A streamed answer's route leaves the request with `hand_over`: the relay (relay.py) finishes it when the
stream ends, which is after the request flow has returned.
"""

from __future__ import annotations

import time
from typing import Callable

from pdserve.orchestrator.routers import Route, RouteRequest


class Request:
    """`cluster`: the orchestrator's LocalCluster or RemoteCluster (select / finish). `release_kv(url,
    disagg_id)` asks a context instance, in the background, to free the KV it holds for `disagg_id`."""

    def __init__(self, api: str, body: dict, disagg_id: int, cluster, release_kv: Callable[[str, int], None]):
        self.api, self.body, self.disagg_id = api, body, disagg_id
        self.route_req = RouteRequest()
        self.arrival = time.monotonic()
        self.dispatched = False  # sent to a first instance (the queue time is measured once)
        self._cluster, self._release_kv = cluster, release_kv
        self._held: dict[str, Route] = {}  # role -> route reserved and not yet finished
        self.kv_at: str | None = None  # the context instance holding this request's KV, not yet pulled

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))

    def held(self, role: str) -> Route | None:
        return self._held.get(role)

    async def reserve(self, role: str, route: Route | None = None) -> Route:
        """The route this request holds on `role`: `route` when given (already reserved), else the one held,
        else a new reservation from the cluster's router."""
        if route is None:
            route = self._held.get(role) or await self._cluster.select(role, self.route_req)
        self._held[role] = route
        return route

    async def finish(self, role: str) -> None:
        """The instance on `role` is done with this request (a no-op when nothing is held there)."""
        route = self._held.pop(role, None)
        if route is not None:
            await self._cluster.finish(role, route.url, self.route_req)

    def hand_over(self, role: str) -> Route:
        """The route on `role`, which from now on its taker finishes (a streamed answer's relay), with
        finish_handed."""
        return self._held.pop(role)

    async def finish_handed(self, role: str, route: Route) -> None:
        """The instance at `route`, a route this request handed over on `role`, is done with it."""
        await self._cluster.finish(role, route.url, self.route_req)

    def kv_pulled(self) -> None:
        """The generation side has the KV: its context instance frees it on its own."""
        self.kv_at = None

    def release_kv(self) -> None:
        """The KV a context instance holds for this request will not be pulled: have it freed now, not after
        the instance's kv_transfer_timeout_ms."""
        if self.kv_at is not None:
            url, self.kv_at = self.kv_at, None
            self._release_kv(url, self.disagg_id)

    def renew(self, disagg_id: int) -> None:
        """A fresh id for running both halves again (the old one may still be in flight somewhere); the old
        attempt's KV is released first."""
        assert self.kv_at is None, "release_kv before renew"
        self.disagg_id = disagg_id

    async def let_go(self) -> None:
        """Give back everything still held: release unpulled KV, finish each held route. Idempotent."""
        self.release_kv()
        for role in list(self._held):
            await self.finish(role)
