"""The membership in etcd (`cluster_storage: etcd://host:port[,host:port...][/prefix]`).

    PREFIX/members/<url>  ->  {"role", "url", "joined_at", "left"}     attached to an etcd lease of lease_ttl_s
    PREFIX/nonces/<nonce> ->  ""                   a member's proof taken (cluster_auth.py): created only
                                                   if absent, on a lease that outlives the proof's window

    join       a new lease, then the key on it
    heartbeat  the key's lease kept alive (a key that is gone or marked left: not a member, join again)
    leave      the key marked left on the same lease: every orchestrator process sees the leave, and
               the key goes when the lease runs out, since nobody renews it
    lost       etcd deletes the key when its lease runs out: no orchestrator has to be up for that

Every orchestrator process reads the same keys (`members()`, every probe round), so a process that
restarts routes to the members at once, and a fleet needs no coordinator. etcd rounds a lease up to
its minimum (about 2 s with the default election timeout) and to whole seconds; `ttl_s` is what it
granted. The client is aetcd (gRPC), an optional extra: pip install 'pdserve[etcd]'.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Callable, TypeVar

from pdserve.orchestrator.membership import HEARTBEATS_PER_LEASE, Member, StoreUnavailable

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379
DEFAULT_PREFIX = "/pdserve"
_CALL_TIMEOUT_S = 2.0
_RETRY_S = 0.5  # between attempts to reach etcd at start
T = TypeVar("T")


def parse_etcd_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """etcd://host:port[,host:port...][/prefix] -> ([(host, port), ...], prefix); ValueError saying what
    is wrong otherwise."""
    example = "etcd://127.0.0.1:2379 or etcd://10.0.0.1:2379,10.0.0.2:2379/my-cluster"
    if not isinstance(url, str) or not url.startswith("etcd://"):
        raise ValueError(f"cluster_storage {url!r} must be an etcd url such as {example}")
    hosts, slash, path = url[len("etcd://"):].partition("/")
    endpoints = []
    for part in hosts.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon:
            host, port = port, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster_storage {url!r}: {part!r} is not host:port (e.g. {example})")
        endpoints.append((host.strip("[]"), int(port)))
    prefix = "/" + path.strip("/") if slash and path.strip("/") else DEFAULT_PREFIX
    return endpoints, prefix


class EtcdStore:
    """MemberStore (membership.py) over etcd; one client per endpoint, the next tried when one is down."""

    def __init__(self, url: str, ttl_s: float):
        try:
            import aetcd
        except ImportError:
            raise ValueError("cluster_storage etcd:// needs the etcd client: pip install 'pdserve[etcd]'") from None
        self.url = url
        endpoints, prefix = parse_etcd_url(url)
        self._prefix = prefix + "/members/"
        self._ttl = max(1, math.ceil(ttl_s))  # etcd leases are whole seconds
        self.ttl_s = float(self._ttl)
        self._clients = [(f"{host}:{port}", aetcd.Client(host, port, timeout=_CALL_TIMEOUT_S))
                         for host, port in endpoints]
        self._client_errors = aetcd.exceptions.ClientError
        self._current = 0
        self._seen: dict[str, tuple[int, float]] = {}  # url -> (lease id, joined_at) as of the last members()
        self._nonce_prefix = prefix + "/nonces/"
        self._nonce_lease: tuple[int, float] | None = None  # (id, monotonic time it ends): shared by many nonces

    @property
    def heartbeat_s(self) -> float:
        return self.ttl_s / HEARTBEATS_PER_LEASE

    def _key(self, url: str) -> bytes:
        return (self._prefix + url).encode()

    async def _call(self, op: Callable, what: str) -> T:
        """op(client) on the endpoint that answered last, then on each other one."""
        problems = []
        for i in range(len(self._clients)):
            k = (self._current + i) % len(self._clients)
            endpoint, client = self._clients[k]
            try:
                out = await op(client)
            except self._client_errors as e:
                problems.append(f"{endpoint}: {type(e).__name__}: {e}")
                continue
            self._current = k
            return out
        raise StoreUnavailable(f"the membership store {self.url} did not answer ({what}; {'; '.join(problems)}): "
                               "is etcd running there, and is cluster_storage right?")

    async def _get(self, url: str) -> tuple[dict, int] | None:
        kv = await self._call(lambda c: c.get(self._key(url)), "read a member")
        if kv is None:
            return None
        return _decode(kv.value), kv.lease

    async def grant(self, url: str, role: str) -> None:
        lease = await self._call(lambda c: c.lease(self._ttl), "grant a lease")
        self.ttl_s = float(lease.ttl)
        now = time.time()
        value = json.dumps({"role": role, "url": url, "joined_at": now, "left": False}).encode()
        await self._call(lambda c: c.put(self._key(url), value, lease=lease.id), "write a member")
        self._seen[url] = (lease.id, now)

    async def renew(self, url: str) -> bool:
        found = await self._get(url)
        if found is None or found[0].get("left", True):
            return False
        reply = await self._call(lambda c: c.refresh_lease(found[1]), "renew a lease")
        return reply is not None and reply.TTL > 0

    async def release(self, url: str) -> str | None:
        found = await self._get(url)
        if found is None or found[0].get("left", True):
            return None
        value, lease = found
        marked = json.dumps({**value, "left": True}).encode()
        await self._call(lambda c: c.put(self._key(url), marked, lease=lease), "mark a member left")
        return value.get("role")

    async def first_use(self, nonce: str, remember_s: float) -> bool:
        lease = await self._nonce_lease_for(remember_s)
        key = (self._nonce_prefix + nonce).encode()

        async def create(c):
            created, _ = await c.transaction(compare=[c.transactions.create(key) == 0],
                                             success=[c.transactions.put(key, b"", lease=lease)], failure=[])
            return created

        return await self._call(create, "remember a proof's nonce")

    async def _nonce_lease_for(self, remember_s: float) -> int:
        """A lease that lasts at least remember_s more: one lease for many nonces, not one per heartbeat."""
        now = time.monotonic()
        if self._nonce_lease is None or self._nonce_lease[1] < now + remember_s:
            ttl = max(1, math.ceil(2 * remember_s))
            lease = await self._call(lambda c: c.lease(ttl), "grant a nonce lease")
            self._nonce_lease = (lease.id, now + lease.ttl)
        return self._nonce_lease[0]

    async def members(self) -> dict[str, Member]:
        found = await self._call(lambda c: c.get_prefix(self._prefix.encode()), "list the members")
        out, seen = {}, {}
        for kv in found:
            url = kv.key.decode(errors="replace")[len(self._prefix):]
            value = _decode(kv.value)
            if value.get("role") not in ("context", "generation"):
                log.warning("ignoring %s in %s: not a pdserve member record", kv.key, self.url)
                continue
            out[url] = Member(value["role"], bool(value.get("left")))
            seen[url] = (kv.lease, float(value.get("joined_at") or 0))
        self._seen = seen
        return out

    async def describe(self, url: str) -> dict | None:
        if url not in self._seen:
            return None
        lease, joined_at = self._seen[url]
        out = {"joined_s_ago": round(time.time() - joined_at, 3), "ttl_s": self.ttl_s, "store": "etcd"}
        try:
            info = await self._call(lambda c: c.get_lease_info(lease, keys=False), "read a lease")
        except StoreUnavailable:
            return out
        if info.TTL >= 0:  # -1: the lease is gone
            out["renewed_s_ago"] = float(info.grantedTTL - info.TTL)  # whole seconds: etcd's resolution
        return out

    async def close(self) -> None:
        for _, client in self._clients:
            await client.close()


def wait_for_etcd(url: str, timeout_s: float) -> None:
    """Before the orchestrator starts (`pdserve disaggregated`): ask etcd until it answers, for at most
    timeout_s (server_start_timeout); StoreUnavailable saying what to fix otherwise."""

    async def ask() -> None:
        store = EtcdStore(url, 1)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    await store.members()
                    return
                except StoreUnavailable as e:
                    if time.monotonic() + _RETRY_S > deadline:
                        raise StoreUnavailable(f"{e} (waited server_start_timeout={timeout_s:g} s)") from None
                await asyncio.sleep(_RETRY_S)
        finally:
            await store.close()

    asyncio.run(ask())


def _decode(raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
