"""How long a supervisor waits before it starts a member that died again: `pdserve launch` (local.py)
and the server actors of `pdserve launch --ray` (ray_cluster.py) use the same rule.

    failures in a row:  1     2      3      ...  max_restarts+1 and on
    wait:               b     2b     4b     ...  b * 2^max_restarts   (b = restart_backoff_s)

A member is restarted as often as it dies; nothing stops the cluster for it. A member that had run for
at least `reset_after_s` when it died starts over at b: one crash a day is not a crash loop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RestartBackoff:
    first_s: float  # restart_backoff_s
    doublings: int  # max_restarts: the failure in a row after which the wait stops growing
    reset_after_s: float  # restart_reset_s
    in_a_row: int = 0  # failures since the member last ran for reset_after_s
    total: int = 0  # every failure of the member

    @property
    def cap_s(self) -> float:
        return self.first_s * 2 ** self.doublings

    def failed(self, uptime_s: float) -> float:
        """A failure after `uptime_s` seconds of running: counts it, and returns the seconds to wait before
        starting the member again."""
        if uptime_s >= self.reset_after_s:
            self.in_a_row = 0
        wait = self.first_s * 2 ** min(self.in_a_row, self.doublings)
        self.in_a_row += 1
        self.total += 1
        return wait
