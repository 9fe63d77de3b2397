"""The router interface: what a router is asked (RouteRequest), what it answers (Route), and the
in-flight bookkeeping every policy shares.

`select` reserves load on the chosen instance; the caller must `finish` it exactly once (a finish on an
instance that has left since is a no-op). Instances come and go with `add` and `remove` (dynamic
membership, membership.py). A policy subclasses `Router` and implements `_pick` (routers.py,
kv_cache_aware.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.orchestrator.config import RouterConfig


class NoReadyInstance(Exception):
    """Every instance of the role is down or still starting."""


@dataclass
class RouteRequest:
    """What a router may look at. token_ids only when the request was tokenized (kv_cache_aware,
    conditional disaggregation, or load_balancing by tokens)."""

    num_tokens: int = 0
    token_ids: list[int] | None = None
    session_key: str | None = None

    def to_json(self) -> dict:
        return {"num_tokens": self.num_tokens, "token_ids": self.token_ids, "session_key": self.session_key}

    @classmethod
    def from_json(cls, data: dict) -> "RouteRequest":
        return cls(num_tokens=int(data.get("num_tokens") or 0), token_ids=data.get("token_ids"),
                   session_key=data.get("session_key"))


@dataclass
class Route:
    url: str
    matched_blocks: int = 0  # prefix blocks the instance already holds (kv_cache_aware only)
    tokens_per_block: int | None = None


@dataclass
class _Load:
    requests: int = 0
    tokens: int = 0


class Router:
    kind = "base"

    def __init__(self, urls: list[str], config: RouterConfig):
        self.urls = list(urls)
        self.config = config
        self.ready: set[str] = set()
        self.load: dict[str, _Load] = {u: _Load() for u in self.urls}
        self.selected: dict[str, int] = {u: 0 for u in self.urls}

    def set_ready(self, url: str, ready: bool) -> None:
        (self.ready.add if ready else self.ready.discard)(url)

    def add(self, url: str) -> None:
        """A new instance, not ready until set_ready says so."""
        if url not in self.load:
            self.urls.append(url)
            self.load[url] = _Load()
            self.selected[url] = 0

    async def remove(self, url: str) -> None:
        """Forget an instance that left; requests still running there finish as no-ops."""
        if url in self.load:
            self.urls.remove(url)
            self.ready.discard(url)
            del self.load[url], self.selected[url]

    def _candidates(self) -> list[str]:
        ready = [u for u in self.urls if u in self.ready]  # config order: ties break deterministically
        if not ready:
            raise NoReadyInstance(f"no ready instance among {', '.join(self.urls)}")
        return ready

    def _pick(self, req: RouteRequest) -> Route:
        raise NotImplementedError

    def select(self, req: RouteRequest) -> Route:
        route = self._pick(req)
        load = self.load[route.url]
        load.requests += 1
        load.tokens += req.num_tokens
        self.selected[route.url] += 1
        return route

    def finish(self, url: str, req: RouteRequest) -> None:
        load = self.load.get(url)
        if load is None:  # the instance left while the request ran
            return
        assert load.requests > 0, f"finish without select on {url}"
        load.requests -= 1
        load.tokens -= req.num_tokens

    def snapshot(self) -> dict[str, Any]:
        return {"type": self.kind, "instances": [
            {"url": u, "ready": u in self.ready, "in_flight_requests": self.load[u].requests,
             "in_flight_tokens": self.load[u].tokens, "selected": self.selected[u]} for u in self.urls]}

    @property
    def needs_tokens(self) -> bool:
        return False

    async def start(self, http) -> None:
        """Start background work (KV event subscriptions); `http` is the process's httpx client."""

    async def close(self) -> None:
        pass
