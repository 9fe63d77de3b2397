"""Dynamic membership: worker instances that join a cluster by themselves and hold a lease.

    pdserve serve --join ORCH --role R ──POST /cluster/join {role, url}──> orchestrator: checks the
                                                                            instance, routes to it
                                       ──POST /cluster/heartbeat {url}───> renews the lease
                                          (every lease_ttl_s / 3)          (404: not a member, join again)
                                       ──POST /cluster/leave {url}───────> out of routing at once
                                          (on drain or shutdown)

A member whose lease is not renewed within `lease_ttl_s` is lost: taken out of routing and
forgotten, and a `pdserve serve` that comes back joins again. The urls in the orchestrator's YAML
are members too, without a lease: they stay until the orchestrator stops.

Where the membership is kept (`cluster_storage`):
- the built-in store (`Leases`, the default): this process's memory. An orchestrator that restarts has
  no members until they heartbeat, get a 404 and join again (about one heartbeat).
- etcd (`etcd://host:port[,host:port...][/prefix]`, etcd_store.py): a member is a key under
  PREFIX/members/ held by an etcd lease, so etcd does the expiry, and every orchestrator process reads
  the same members. A restarted orchestrator routes to them at its first probe round, and a fleet
  needs no coordinator.

Each store also keeps the nonces of the members' proofs (`first_use`, pdserve/cluster_auth.py), so a
proof replayed to any orchestrator process that reads the same store is refused: the built-in store in
memory (lost at a restart, which loses the leases too: a replayed join then re-admits the instance
that signed it, which the orchestrator challenges as any joiner, and a replayed heartbeat or leave
finds no member), etcd under PREFIX/nonces/.

Both have the async interface of `MemberStore`; LocalCluster (cluster.py) does the checks and the
routing around it and syncs its routers with `members()` every probe round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

from pdserve.cluster_auth import SeenNonces

# Heartbeats per lease: a member survives two lost heartbeats in a row.
HEARTBEATS_PER_LEASE = 3


@dataclass
class MemberLease:
    """An instance's membership: it joined at joined_at and stays while it renews (heartbeats)."""

    role: str
    joined_at: float
    renewed_at: float


@dataclass(frozen=True)
class Member:
    role: str
    left: bool = False  # it left (a clean leave), and other orchestrator processes have yet to see that


class StoreUnavailable(Exception):
    """The membership store cannot be reached; the message says which and what to check."""


class MemberStore(Protocol):
    ttl_s: float  # the lease a member holds: what the store grants, which may round it up

    @property
    def heartbeat_s(self) -> float: ...

    async def grant(self, url: str, role: str) -> None:
        """Make `url` a member of `role` with a fresh lease (a join, or a join again)."""

    async def renew(self, url: str) -> bool:
        """Renew the lease; False when `url` holds none (never joined, left, or lost): it must join again."""

    async def release(self, url: str) -> str | None:
        """End the membership now (a leave); the role it had, or None when it was not a member."""

    async def members(self) -> dict[str, Member]:
        """Every url whose lease is live, and those that left since about one lease ago."""

    async def first_use(self, nonce: str, remember_s: float) -> bool:
        """True the first time a proof's nonce is presented (kept remember_s); False for a replay."""

    async def describe(self, url: str) -> dict | None:
        """What /cluster_info shows of a member's lease (None: not a member, e.g. one of the YAML)."""

    async def close(self) -> None: ...


class Leases:
    """The built-in store: leases in this process's memory, with an injectable clock."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self.clock = clock
        self._leases: dict[str, MemberLease] = {}  # url -> its lease
        self._nonces = SeenNonces(clock=clock)

    @property
    def heartbeat_s(self) -> float:
        return self.ttl_s / HEARTBEATS_PER_LEASE

    async def grant(self, url: str, role: str) -> None:
        now = self.clock()
        self._leases[url] = MemberLease(role, now, now)

    async def renew(self, url: str) -> bool:
        lease = self._leases.get(url)
        if lease is None:
            return False
        lease.renewed_at = self.clock()
        return True

    async def release(self, url: str) -> str | None:
        lease = self._leases.pop(url, None)
        return None if lease is None else lease.role

    async def members(self) -> dict[str, Member]:
        # a leave is seen by the one process that keeps these leases, so none is marked left
        now = self.clock()
        for url in [url for url, lease in self._leases.items() if now - lease.renewed_at > self.ttl_s]:
            del self._leases[url]
        return {url: Member(lease.role) for url, lease in self._leases.items()}

    async def first_use(self, nonce: str, remember_s: float) -> bool:
        return self._nonces.first_use(nonce, remember_s)

    async def describe(self, url: str) -> dict | None:
        lease = self._leases.get(url)
        if lease is None:
            return None
        now = self.clock()
        return {"joined_s_ago": round(now - lease.joined_at, 3), "renewed_s_ago": round(now - lease.renewed_at, 3),
                "ttl_s": self.ttl_s}

    async def close(self) -> None:
        pass

