"""What one orchestrator request holds (routes, unpulled context KV) is given back once, on any exit.

The cluster here only records select / finish: the routers are not what these tests are about (the flow
tests in test_disagg_flow.py and test_peer_death.py drive the same object through real workers)."""

import asyncio

import pytest

from pdserve.orchestrator.request import Request
from pdserve.orchestrator.routers import Route


class RecordingCluster:
    def __init__(self):
        self.selected: list[str] = []
        self.finished: list[tuple[str, str]] = []

    async def select(self, role, route_req):
        url = f"http://{role}-{len(self.selected)}"
        self.selected.append(url)
        return Route(url)

    async def finish(self, role, url, route_req):
        self.finished.append((role, url))


def _request(cluster, released):
    return Request("/v1/completions", {"prompt": "x"}, 7, cluster, lambda url, rid: released.append((url, rid)))


def test_let_go_finishes_each_held_route_and_releases_unpulled_kv_once():
    cluster, released = RecordingCluster(), []
    req = _request(cluster, released)

    async def flow():
        ctx = await req.reserve("context")
        gen = await req.reserve("generation")
        assert await req.reserve("generation") is gen  # held: not selected again
        req.kv_at = ctx.url
        await req.let_go()
        await req.let_go()  # a second exit path gives back nothing twice

    asyncio.run(flow())
    assert cluster.selected == ["http://context-0", "http://generation-1"]
    assert sorted(cluster.finished) == [("context", "http://context-0"), ("generation", "http://generation-1")]
    assert released == [("http://context-0", 7)]


def test_a_handed_over_route_and_pulled_kv_are_not_given_back():
    cluster, released = RecordingCluster(), []
    req = _request(cluster, released)

    async def flow():
        await req.reserve("generation")
        route = req.hand_over("generation")  # a streamed answer's relay finishes it
        req.kv_at = "http://ctx"
        req.kv_pulled()
        await req.let_go()
        return route

    route = asyncio.run(flow())
    assert route.url == "http://generation-0"
    assert cluster.finished == [] and released == []


def test_a_fresh_id_comes_after_the_old_attempts_kv_is_released():
    cluster, released = RecordingCluster(), []
    req = _request(cluster, released)
    req.kv_at = "http://ctx"
    with pytest.raises(AssertionError, match="release_kv before renew"):
        req.renew(8)
    req.release_kv()
    req.renew(8)
    assert req.disagg_id == 8 and released == [("http://ctx", 7)]
