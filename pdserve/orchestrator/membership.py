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

`Leases` is the bookkeeping only (no I/O, an injectable clock); LocalCluster (cluster.py) does the
checks and the routing around it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

# Heartbeats per lease: a member survives two lost heartbeats in a row.
HEARTBEATS_PER_LEASE = 3


@dataclass
class Lease:
    role: str
    joined_at: float
    renewed_at: float


class Leases:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}  # url -> its lease

    @property
    def heartbeat_s(self) -> float:
        return self.ttl_s / HEARTBEATS_PER_LEASE

    def __contains__(self, url: str) -> bool:
        return url in self._leases

    def grant(self, url: str, role: str) -> None:
        now = self.clock()
        self._leases[url] = Lease(role, now, now)

    def renew(self, url: str) -> bool:
        """False when `url` holds no lease (never joined, left, or lost): it must join again."""
        lease = self._leases.get(url)
        if lease is None:
            return False
        lease.renewed_at = self.clock()
        return True

    def release(self, url: str) -> Lease | None:
        return self._leases.pop(url, None)

    def expired(self) -> list[tuple[str, Lease]]:
        """Take out and return every lease not renewed within ttl_s."""
        now = self.clock()
        gone = [(url, lease) for url, lease in self._leases.items() if now - lease.renewed_at > self.ttl_s]
        for url, _ in gone:
            del self._leases[url]
        return gone

    def describe(self, url: str) -> dict | None:
        """What /cluster_info shows of a member's lease (None for a member from the YAML)."""
        lease = self._leases.get(url)
        if lease is None:
            return None
        now = self.clock()
        return {"joined_s_ago": round(now - lease.joined_at, 3), "renewed_s_ago": round(now - lease.renewed_at, 3),
                "ttl_s": self.ttl_s}
