"""Per-request transfer sessions of the transceiver, and the status each one reports on this rank.

Lifecycle of a send session (context rank):

    respond_and_send_async ──> waiting for REQUEST_DATA from every generation rank
        ──> one write per chunk and requester this rank owns bytes of (others are "served" with
            no write); a whole-prompt send is one chunk, a pipelined send adds a chunk per prefill
            step and a requester is served once the chunk flagged last was submitted to it
        ──> DONE once every requester is served and every write landed
        (CANCEL / timeout / write failure ──> FAILED, but only once no write is in flight)

Lifecycle of a receive session (generation rank):

    request_and_receive_async ──> session registered ──> REQUEST_DATA published to every ctx rank
        (first contact with a context instance: REQUEST_DATA is held until the canary passed;
        a failed canary refuses the held sessions, which then fail at once)
        ──> DONE when every expected writer's TRANSFER_DONE notifications all arrived (the one
            flagged last says how many chunks to expect)
        (TRANSFER_ERROR, UNKNOWN_REQUEST / timeout ──> FAILED; cancel ──> CANCEL sent, removed once
        writers settle)

A session entry exists exactly while the request is in flight: empty tables mean "all done".
A session's status is this rank's alone; the executor settles a request once every rank of its
instance reported it (engine/kv/connector.py, TransferTally).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from pdserve.kv_transfer.agents.base import TransferHandle
from pdserve.kv_transfer.control.messages import PeerKey, RequestData
from pdserve.kv_transfer.rank_info import RankInfo


class TransferStatus(enum.IntEnum):
    """One rank's view of a session, from the most cautious: still moving bytes, failed, done."""

    IN_PROGRESS = 0
    FAILED = 1
    DONE = 2


@dataclass
class TransferResults:
    """What one status check finished: request ids that completed, and failures with reasons.
    For completed receive sessions also the prompt tokens delivered (when the sender said) and the
    state that rode with the last chunk (when there was one); `unknown`: the failed receive sessions
    whose context side said it holds no such request."""

    completed: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    states: dict[int, bytes] = field(default_factory=dict)
    unknown: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.completed) + len(self.failed)

    def merge(self, other: "TransferResults") -> None:
        self.completed += other.completed
        self.failed.update(other.failed)
        self.tokens.update(other.tokens)
        self.states.update(other.states)
        self.unknown += other.unknown


@dataclass(frozen=True)
class SendChunk:
    """One piece of a send: src block ids per layer group (-1 = not in this piece)."""

    block_ids: dict[int, np.ndarray]
    token_range: tuple[int, int]  # the exact prompt tokens this piece completes; (0, 0) = unsaid
    last: bool
    state: bytes = b""  # rides with the last piece's notification


WriteKey = tuple[PeerKey, int]  # (requester, chunk index)


@dataclass
class SendSession:
    """A context rank's outgoing transfer of one request."""

    disagg_id: int
    deadline: float
    chunks: list[SendChunk] = field(default_factory=list)  # offered so far, in order
    num_requesters: int | None = None  # learnt from the first REQUEST_DATA
    served: set[PeerKey] = field(default_factory=set)  # requesters that need nothing more from us
    targets: dict[PeerKey, RequestData] = field(default_factory=dict)  # requesters we write to, still owed chunks
    sent: dict[PeerKey, int] = field(default_factory=dict)  # chunks submitted per target
    writes: dict[WriteKey, TransferHandle] = field(default_factory=dict)  # in flight only
    staging: dict[WriteKey, object] = field(default_factory=dict)  # bounce leases of in-flight writes
    refuse_after_writes: dict[PeerKey, str] = field(default_factory=dict)  # told once its writes landed
    error: str | None = None

    @property
    def offered_all(self) -> bool:
        return bool(self.chunks) and self.chunks[-1].last

    def writing_to(self, peer: PeerKey) -> bool:
        return any(key[0] == peer for key in self.writes)

    def local_status(self) -> TransferStatus:
        if self.writes:
            return TransferStatus.IN_PROGRESS
        if self.error is not None:
            return TransferStatus.FAILED
        if time.monotonic() > self.deadline:
            self.error = f"request {self.disagg_id}: context side timed out waiting for the generation side"
            return TransferStatus.FAILED
        if self.num_requesters is not None and len(self.served) >= self.num_requesters:
            return TransferStatus.DONE
        return TransferStatus.IN_PROGRESS


@dataclass
class RecvSession:
    """A generation rank's incoming transfer of one request."""

    disagg_id: int
    writers: dict[PeerKey, str]  # ctx rank key -> its control endpoint, for CANCEL
    all_ctx: dict[PeerKey, str]  # every ctx rank we sent REQUEST_DATA to
    deadline: float
    done: set[PeerKey] = field(default_factory=set)
    errors: dict[PeerKey, str] = field(default_factory=dict)
    cancel_sent: bool = False
    chunks_seen: dict[PeerKey, int] = field(default_factory=dict)
    chunks_total: dict[PeerKey, int] = field(default_factory=dict)  # known from each writer's last chunk
    tokens: int = 0  # prompt tokens delivered so far (the largest token-range end any writer reported)
    state: bytes = b""
    staging: object | None = None  # bounce.StagingLease on our staging buffer, released with the session
    bounce_slot: int = 0  # bytes of staging per writer; writer i writes at staging.ptr + i * slot
    bounce_writers: tuple[int, ...] = ()  # ctx ranks in segment order
    writer_infos: dict[PeerKey, RankInfo] = field(default_factory=dict)  # to re-plan a write for its checksum
    block_ids: dict[int, np.ndarray] = field(default_factory=dict)  # our destination ids per layer group
    checksum: bool = False  # we asked every writer for KV checksums
    corrupted: dict[PeerKey, str] = field(default_factory=dict)  # failed checksums, an error once the writer is done
    held: list[tuple[str, RequestData]] = field(default_factory=list)  # unsent until the first-contact canary passes
    refused: str | None = None  # nothing will be written (the canary failed): fails at once
    unknown: bool = False  # a context rank said it holds no such request (UNKNOWN_REQUEST)

    def on_chunk(self, sender: PeerKey, chunk: int, last: bool, token_range: tuple[int, int], state: bytes) -> None:
        """One write of `sender` landed; the writer is done once all its chunks have."""
        self.chunks_seen[sender] = self.chunks_seen.get(sender, 0) + 1
        if last:
            self.chunks_total[sender] = chunk + 1
            self.state = self.state or state
        self.tokens = max(self.tokens, token_range[1])
        if self.chunks_seen[sender] == self.chunks_total.get(sender):
            self.done.add(sender)
            if sender in self.corrupted:  # only now: until its last write landed, our blocks are not free
                self.errors.setdefault(sender, self.corrupted[sender])

    @property
    def settled(self) -> bool:
        """Every expected writer either delivered or said it will not write."""
        return self.refused is not None or all(k in self.done or k in self.errors for k in self.writers)

    def local_status(self) -> TransferStatus:
        if self.refused is not None or (self.errors and self.settled):
            return TransferStatus.FAILED
        if len(self.done) == len(self.writers) and self.settled:
            return TransferStatus.DONE
        if time.monotonic() > self.deadline:
            missing = sorted(set(self.writers) - self.done)
            if self.held:
                stage = "the first-contact canary with the context instance did not finish"
            elif any(self.chunks_seen.get(k) for k in missing):
                stage = "its writes stopped part way"
            else:
                stage = "no write was reported: the context side never wrote, or its notification was lost"
            self.errors.setdefault(("timeout", -1), "timed out waiting for context ranks "
                                   + ", ".join(f"{k[0]} rank {k[1]}" for k in missing) + f" ({stage})")
            return TransferStatus.FAILED
        return TransferStatus.IN_PROGRESS

    def error_text(self) -> str:
        def who(key: PeerKey) -> str:
            return "" if key[0] == "timeout" else f"{key[0]} rank {key[1]}: "

        text = "; ".join(f"{who(k)}{v}" for k, v in sorted(self.errors.items(), key=lambda kv: str(kv[0])))
        return "; ".join(t for t in (self.refused, text) if t)

