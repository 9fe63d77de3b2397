"""Routers: which instance of one role serves a request.

A router knows its role's instance urls, which of them are ready, and what each has in flight. It is
synchronous and owned by one event loop: the orchestrator's (one process) or the coordinator's (fleet).

    round_robin     next ready instance in turn
    load_balancing  fewest in-flight requests (metric: requests) or prompt tokens (metric: tokens)
    kv_cache_aware  most prefix blocks already cached minus load (kv_cache_aware.py)
    conversation    the instance that served this conversation before, else the least loaded

`select` reserves load on the chosen instance; the caller must `finish` it exactly once.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pdserve.disagg.config import RouterConfig


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
        load = self.load[url]
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


class RoundRobinRouter(Router):
    kind = "round_robin"

    def __init__(self, urls, config):
        super().__init__(urls, config)
        self._next = 0

    def _pick(self, req):
        ready = self._candidates()
        # Walk the configured order so a recovering instance rejoins its turn.
        for i in range(len(self.urls)):
            url = self.urls[(self._next + i) % len(self.urls)]
            if url in ready:
                self._next = (self.urls.index(url) + 1) % len(self.urls)
                return Route(url)
        raise AssertionError("unreachable: _candidates returned ready urls")


class LoadBalancingRouter(Router):
    kind = "load_balancing"

    def _pick(self, req):
        by_tokens = self.config.option("metric") == "tokens"
        return Route(min(self._candidates(), key=lambda u: (
            self.load[u].tokens if by_tokens else self.load[u].requests, self.selected[u])))


class ConversationRouter(Router):
    """Session affinity: a conversation keeps its instance (and so its prefix cache) while that
    instance is ready; a new or orphaned conversation goes to the least-loaded instance."""

    kind = "conversation"

    def __init__(self, urls, config):
        super().__init__(urls, config)
        self.sessions: OrderedDict[str, str] = OrderedDict()

    def _pick(self, req):
        ready = self._candidates()
        key = req.session_key
        url = self.sessions.get(key) if key is not None else None
        if url is None or url not in ready:
            url = min(ready, key=lambda u: (self.load[u].requests, self.selected[u]))
        if key is not None:
            self.sessions[key] = url
            self.sessions.move_to_end(key)
            while len(self.sessions) > self.config.option("max_sessions"):
                self.sessions.popitem(last=False)
        return Route(url)

    def snapshot(self):
        return {**super().snapshot(), "sessions": len(self.sessions)}


def session_key(body: dict, conversation_id: str | None, config: RouterConfig) -> str | None:
    """The conversation a request belongs to: an explicit id (header X-Conversation-Id or body
    'conversation_id'), else a hash of the first messages (chat) or prompt characters (completions)."""
    if conversation_id is None and isinstance(body.get("conversation_id"), str):
        conversation_id = body["conversation_id"]
    if conversation_id is not None:
        return "id:" + conversation_id
    if config.type != "conversation":
        return None
    if isinstance(body.get("messages"), list):
        head: Any = body["messages"][:config.option("prefix_messages")]
    elif isinstance(body.get("prompt"), str):
        head = body["prompt"][:config.option("prefix_chars")]
    elif isinstance(body.get("prompt"), list):
        head = body["prompt"][:config.option("prefix_chars")]
    else:
        return None
    digest = hashlib.sha256(json.dumps(head, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return "prefix:" + digest


def make_router(urls: list[str], config: RouterConfig) -> Router:
    from pdserve.disagg.kv_cache_aware import KvCacheAwareRouter

    classes: dict[str, type[Router]] = {"round_robin": RoundRobinRouter, "load_balancing": LoadBalancingRouter,
                                        "kv_cache_aware": KvCacheAwareRouter, "conversation": ConversationRouter}
    return classes[config.type](urls, config)
