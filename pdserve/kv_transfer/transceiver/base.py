"""What every part of one rank's transceiver shares: its config, the rank it runs on, the clock and
the counters the benchmarks read."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from pdserve.kv_transfer.agents.base import TransferAgent
from pdserve.kv_transfer.bounce import BounceConfig
from pdserve.kv_transfer.control.messenger import DEFAULT_MAX_MESSAGE_BYTES
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.rank_info import RankInfo

# Bound on how many ended request ids a rank remembers (to refuse their late messages).
REMEMBER_CLOSED = 4096


@dataclass(frozen=True)
class TransceiverConfig:
    kv_transfer_timeout_ms: int = 30_000  # a session older than this errors out and releases everything
    rank_info_timeout_s: float = 5.0  # the first contact with a context instance
    bounce: BounceConfig | None = None  # None = direct writes only (the default)
    max_control_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # a peer sending a bigger frame is disconnected
    cluster_token: str | None = field(default=None, repr=False)  # set: CURVE on the control plane (messenger.py)
    checksum: bool = False  # ask for (and send) a CRC32 per block with every write (integrity.py)
    peer_lost_ms: int = 2_000  # a writer whose control endpoint has had no connection this long fails its sessions

    def __post_init__(self) -> None:
        if self.kv_transfer_timeout_ms <= 0:
            raise ValueError(f"kv_transfer_timeout_ms must be > 0, got {self.kv_transfer_timeout_ms}")
        if self.rank_info_timeout_s <= 0:
            raise ValueError(f"rank_info_timeout_s must be > 0, got {self.rank_info_timeout_s}")
        if self.peer_lost_ms <= 0:
            raise ValueError(f"peer_lost_ms must be > 0, got {self.peer_lost_ms}")


class Local:
    """This rank as the parts of its transceiver see it. `own` and `instance` are set by start()."""

    def __init__(self, agent: TransferAgent, config: TransceiverConfig) -> None:
        self.agent = agent
        self.config = config
        self.own: RankInfo | None = None
        self.instance: tuple[RankInfo, ...] = ()  # every rank of our instance, by rank
        self.stats = {"direct_writes": 0, "bounced_writes": 0, "fragments_written": 0, "bytes_written": 0}
        # Cumulative seconds of this rank's CPU stages (benchmarks diff them per request): plan =
        # plan_write, gather / scatter = bounce copies, submit = the agent's submit_write call.
        self.stage_seconds = dict.fromkeys(("plan", "gather", "submit", "scatter", "checksum"), 0.0)

    @property
    def key(self):
        return self.own and self.own.key

    def require_started(self) -> RankInfo:
        if self.own is None:
            raise KVTransferError("KVTransceiver.start(rank_info, instance_ranks) must be called first")
        return self.own

    def deadline(self) -> float:
        return time.monotonic() + self.config.kv_transfer_timeout_ms / 1000.0

    def dp_group(self) -> tuple[RankInfo, ...]:
        """The ranks of our instance in our DP group: every one of them asks (or serves) each request."""
        return tuple(r for r in self.instance if r.dp_rank == self.own.dp_rank)

    def kv_on_device(self) -> bool:
        return any(r.is_device for r in self.agent.registered_regions)

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Add the block's seconds to `stage` (when it does not raise)."""
        t0 = time.perf_counter()
        yield
        self.stage_seconds[stage] += time.perf_counter() - t0
