"""Routers: which instance of one role serves a request.

A router knows its role's instance urls, which of them are ready, and what each has in flight. It is
synchronous and owned by one event loop: the orchestrator's (one process) or the coordinator's (fleet).

    round_robin     next ready instance in turn
    load_balancing  fewest in-flight requests (metric: requests) or prompt tokens (metric: tokens)
    kv_cache_aware  most prefix blocks already cached minus load (kv_cache_aware.py)
    conversation    the instance that served this conversation before, else the least loaded

The interface the policies share (RouteRequest, Route, Router) is in router_base.py; this module
re-exports it with the policies, so callers import routing from here.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

from pdserve.orchestrator.config import RouterConfig
from pdserve.orchestrator.kv_cache_aware import KvCacheAwareRouter
from pdserve.orchestrator.router_base import NoReadyInstance, Route, RouteRequest, Router

__all__ = ["ConversationRouter", "KvCacheAwareRouter", "LoadBalancingRouter", "NoReadyInstance", "RoundRobinRouter",
           "Route", "RouteRequest", "Router", "make_router", "session_key"]


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

    async def remove(self, url):
        await super().remove(url)
        for key in [k for k, u in self.sessions.items() if u == url]:
            del self.sessions[key]

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
    classes: dict[str, type[Router]] = {"round_robin": RoundRobinRouter, "load_balancing": LoadBalancingRouter,
                                        "kv_cache_aware": KvCacheAwareRouter, "conversation": ConversationRouter}
    return classes[config.type](urls, config)
