"""KVTransceiver: the API an engine executor drives to move a request's KV between instances.

One transceiver per rank. Setup (every rank of both instances)::

    agent = make_agent(config.backend); agent.register_memory(MemoryRegion.of_tensor(kv_pool))
    tx = KVTransceiver(agent, TransceiverConfig(...), host=advertised_host)
    info = RankInfo(..., agent_descriptor=tx.local_descriptor(), control_endpoint=tx.endpoint)
    tx.start(info, instance_ranks)          # instance_ranks: all RankInfos of this instance (allgather)

Context side: `respond_and_send_async(rid, block_ids)` then poll `check_context_transfer_status()`;
free the KV of requests it reports. Pipelined: call it once per prefill chunk with that chunk's
blocks (`chunking.chunk_blocks`) and `last=False` until the final chunk; each chunk is written to
every requester as soon as both the chunk and its REQUEST_DATA are here.

Generation side: `request_and_receive_async(rid, ctx_endpoint, block_ids)` then poll
`check_gen_transfer_status()`; resume decoding of requests it reports.
`cancel_request(rid)` is False while a write may still land (retry next step) and True once the
blocks may be reused. See sessions.py for the lifecycles.

Threads: the ZeroMQ listener only answers RankInfo requests from immutable state and enqueues
everything else; all session state and every agent call live on the caller's (executor) thread.
Address arithmetic happens only on the sender (`registrar.plan_write`); the receiver derives just
which ctx ranks will write to it (`registrar.writers_for`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from pdserve.kv_transfer import canary
from pdserve.kv_transfer.agents.base import RegionTable, TransferAgent, TransferState
from pdserve.kv_transfer.bounce import BounceConfig, StagingBuffer, gather, plan_segment_bytes, scatter, segment_bound
from pdserve.kv_transfer.control.messages import (
    Cancel,
    Message,
    PeerKey,
    ProtocolError,
    RankInfoReply,
    RankInfoRequest,
    RegisterPeer,
    RequestData,
    TransferDone,
    TransferError,
    decode,
)
from pdserve.kv_transfer.control.messenger import DEFAULT_MAX_MESSAGE_BYTES, Messenger
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.integrity import block_digests, first_mismatch, to_wire
from pdserve.kv_transfer.rank_info import RankInfo
from pdserve.kv_transfer.registrar import plan_write, writers_for
from pdserve.kv_transfer.sessions import RecvSession, SendChunk, SendSession, TransferResults, TransferStatus

logger = logging.getLogger(__name__)

# Longest wait between two polls of the agent inside `at_least` waits. Control messages wake the wait
# at once; agent completions and notifications can only be polled. A poll step costs ~20-30 us of
# CPU: 0.1 ms keeps detection well under a millisecond (a 10 ms write loses <1%) for ~20% of one
# core while the executor has nothing else to do. Busy polling is worse, not better: it starves
# NIXL's UCX progress thread on small machines.
POLL_INTERVAL_S = 0.0001
_REMEMBER_CLOSED = 4096


@dataclass(frozen=True)
class TransceiverConfig:
    kv_transfer_timeout_ms: int = 30_000  # a session older than this errors out and releases everything
    rank_info_timeout_s: float = 5.0  # the first contact with a context instance
    bounce: BounceConfig | None = None  # None = direct writes only (the default)
    max_control_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # a peer sending a bigger frame is disconnected
    cluster_token: str | None = field(default=None, repr=False)  # set: CURVE on the control plane (messenger.py)
    checksum: bool = False  # ask for (and send) a CRC32 per block with every write (integrity.py)

    def __post_init__(self) -> None:
        if self.kv_transfer_timeout_ms <= 0:
            raise ValueError(f"kv_transfer_timeout_ms must be > 0, got {self.kv_transfer_timeout_ms}")
        if self.rank_info_timeout_s <= 0:
            raise ValueError(f"rank_info_timeout_s must be > 0, got {self.rank_info_timeout_s}")


class KVTransceiver:
    def __init__(self, agent: TransferAgent, config: TransceiverConfig | None = None,
                 host: str = "127.0.0.1") -> None:
        self.agent = agent
        self.config = config or TransceiverConfig()
        self._events: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._wake = threading.Event()  # set by the listener when it enqueues a message
        self._own: RankInfo | None = None
        self._instance: tuple[RankInfo, ...] = ()
        self._instance_reply: RankInfoReply | None = None
        self._ctx_instances: dict[str, tuple[RankInfo, ...]] = {}  # ctx endpoint -> its ranks (cached)
        self._registered_with: set[PeerKey] = set()
        self._gen_peers: dict[PeerKey, RankInfo] = {}
        self._loaded_agents: dict[PeerKey, str] = {}
        self.send_sessions: dict[int, SendSession] = {}
        self.recv_sessions: dict[int, RecvSession] = {}
        self._early: dict[int, list[RequestData]] = {}  # REQUEST_DATA before our offer, by request id
        self._early_deadline: dict[int, float] = {}  # ... refused once kv_transfer_timeout_ms passed
        self._cancelled_early: OrderedDict[int, str] = OrderedDict()  # CANCEL before our offer
        self._closed_sends: OrderedDict[int, None] = OrderedDict()
        self._gates: dict[str, canary.Gate] = {}  # ctx endpoint -> first-contact canary (generation side)
        self.stats = {"direct_writes": 0, "bounced_writes": 0, "fragments_written": 0, "bytes_written": 0}
        self.canary_writes = 0  # first-contact canaries this rank wrote (kept out of the requests' stats)
        # Cumulative seconds of this rank's CPU stages (benchmarks diff them per request): plan =
        # plan_write, gather / scatter = bounce copies, submit = the agent's submit_write call.
        self.stage_seconds = dict.fromkeys(("plan", "gather", "submit", "scatter", "checksum"), 0.0)
        if self.config.checksum and any(r.is_device for r in agent.registered_regions):
            raise KVTransferError("checksum needs the KV cache in host memory; this rank registered device memory "
                                  "(turn cache_transceiver_config.checksum off)")
        # Registered before local_descriptor() is taken, so peers can write into it.
        self._staging = StagingBuffer(agent, self.config.bounce.staging_bytes) if self.config.bounce else None
        self._messenger = Messenger(self._on_message, host=host, name="kv",
                                    max_message_bytes=self.config.max_control_message_bytes,
                                    cluster_token=self.config.cluster_token)

    # -- setup --------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return self._messenger.endpoint

    def local_descriptor(self) -> bytes:
        return self.agent.local_descriptor()

    def start(self, own: RankInfo, instance_ranks: Sequence[RankInfo] | None = None) -> None:
        """Publish this rank (and its instance, answered to RankInfo requests)."""
        ranks = tuple(sorted(instance_ranks or (own,), key=lambda r: r.rank))
        if own not in ranks or len({r.instance_name for r in ranks}) != 1:
            raise ValueError("instance_ranks must hold this rank's RankInfo and only ranks of its instance")
        if [r.rank for r in ranks] != list(range(len(ranks))):
            raise ValueError(f"instance_ranks must be ranks 0..n-1, got {[r.rank for r in ranks]}")
        self._own, self._instance = own, ranks
        self._instance_reply = RankInfoReply([r.to_bytes() for r in ranks])

    def close(self) -> None:
        """Stop the listener and deregister the staging buffer; the caller still owns the agent."""
        self._messenger.close()
        if self._staging is not None:
            self.agent.deregister_memory(self._staging.region)
            self._staging = None

    # -- context side -------------------------------------------------------------------------
    def respond_and_send_async(self, request_id: int, block_ids: Mapping[int, np.ndarray], *,
                               token_range: tuple[int, int] = (0, 0), last: bool = True, state: bytes = b"") -> None:
        """Offer this rank's KV of `request_id` (layer-group id -> src block ids, -1 = skip).

        One call with `last=True` offers the whole prompt. A pipelined send calls once per prefill
        chunk, `last=False` until the final one; every call's ids are positional over the whole
        prompt (blocks not in this chunk are -1), so the receiver's one slice serves all chunks.
        `token_range`: the exact prompt tokens the chunk completes (reported to the receiver); a
        chunk starting after token 0 continues a send, and is dropped if that send already ended.
        `state`: small bytes delivered with the last chunk (e.g. the first generated token)."""
        own = self._require_started()
        session = self.send_sessions.get(request_id)
        if session is not None and session.offered_all:
            raise KVTransferError(f"request {request_id} is already being sent by {own.key}")
        if session is not None and session.error is not None:
            return  # failed (e.g. cancelled) and waiting for its writes to settle: nothing more to offer
        early: list[RequestData] = []
        if session is None and token_range[0] > 0 and request_id in self._closed_sends:
            # A later chunk of a send that already ended (cancelled, failed): drop it, park nothing.
            logger.debug("%s: dropped a chunk of ended request %d", own.key, request_id)
            return
        if session is None:
            self._closed_sends.pop(request_id, None)
            session = self.send_sessions[request_id] = SendSession(
                request_id, self._deadline(), error=self._cancelled_early.pop(request_id, None))
            early = self._early.pop(request_id, [])
            self._early_deadline.pop(request_id, None)
        session.deadline = self._deadline()  # a long pipelined prefill is not a stalled transfer
        ids = {int(g): np.asarray(b, dtype=np.int64) for g, b in block_ids.items()}
        session.chunks.append(SendChunk(ids, (int(token_range[0]), int(token_range[1])), bool(last), bytes(state)))
        for key in list(session.targets):
            self._write_pending(session, self._gen_peers[key])
        for request in early:
            self._serve(request)

    def check_context_transfer_status(self, at_least: int = 0) -> TransferResults:
        """Finished send sessions (their KV may be freed); waits until `at_least` finished, clamped to
        the sessions in flight so an idle loop never sleeps out a timeout."""
        return self._check(self.send_sessions, at_least, self._step_send)

    # -- generation side ----------------------------------------------------------------------
    def request_and_receive_async(self, request_id: int, ctx_endpoint: str,
                                  block_ids: Mapping[int, np.ndarray], token_range: tuple[int, int] = (0, 0),
                                  ctx_dp_rank: int = 0, timeout_ms: float | None = None) -> None:
        """Ask the context instance at `ctx_endpoint` (rank 0's control endpoint) to write
        `request_id`'s KV into our blocks (layer-group id -> dst block ids, -1 = skip).
        `ctx_dp_rank`: the context DP group that holds the request (0 without attention DP).
        `timeout_ms`: what is left of the request's transfer timeout (default: all of it)."""
        own = self._require_started()
        if request_id in self.recv_sessions:
            raise KVTransferError(f"request {request_id} is already being received by {own.key}")
        ctx_ranks = tuple(r for r in self._ctx_ranks(ctx_endpoint) if r.dp_rank == ctx_dp_rank)
        if not ctx_ranks:
            raise KVTransferError(f"context instance at {ctx_endpoint} has no DP group {ctx_dp_rank}")
        try:
            writers = set(writers_for(own, ctx_ranks))
        except KVTransferError:
            # The context ranks hold this request's KV for us: tell them now, not at their timeout.
            for ctx in ctx_ranks:
                self._messenger.send(ctx.control_endpoint, Cancel(request_id, own.key))
            raise
        by_rank = {r.rank: r for r in ctx_ranks}
        session = RecvSession(
            request_id,
            writers={by_rank[w].key: by_rank[w].control_endpoint for w in writers},
            all_ctx={r.key: r.control_endpoint for r in ctx_ranks},
            deadline=self._deadline() if timeout_ms is None else time.monotonic() + timeout_ms / 1000.0,
            writer_infos={by_rank[w].key: by_rank[w] for w in writers},
            checksum=self.config.checksum,
        )
        ids = session.block_ids = {int(g): np.asarray(b, dtype=np.int64) for g, b in block_ids.items()}
        offer = self._bounce_offer(session, ids)
        # Every rank of our DP group asks every ctx rank, so each ctx rank knows when it served all.
        requesters = sum(1 for r in self._instance if r.dp_rank == own.dp_rank)
        # Registered before publishing, so a fast writer's notification always finds its session.
        self.recv_sessions[request_id] = session
        messages = [(ctx.control_endpoint, RequestData(request_id, own.key, ids, tuple(token_range), requesters,
                                                       offer, self.config.checksum)) for ctx in ctx_ranks]
        gate = self._gate(ctx_endpoint, ctx_ranks)
        if gate is not None:  # first contact: asked once the canary passed
            session.held = messages
            gate.held.append(request_id)
            self._start_canary()
            return
        try:
            for endpoint, message in messages:
                self._messenger.send(endpoint, message)
        except Exception:
            self._close_recv(self.recv_sessions.pop(request_id))
            raise

    def check_gen_transfer_status(self, at_least: int = 0) -> TransferResults:
        """Finished receive sessions (their KV is in place); `at_least` as for the context side."""
        return self._check(self.recv_sessions, at_least, self._step_recv)

    # -- both ---------------------------------------------------------------------------------
    def has_inflight_transfer(self) -> bool:
        return bool(self.send_sessions or self.recv_sessions)

    def cancel_request(self, request_id: int) -> bool:
        """False while a write of this request may still land (call again next step); True once its
        blocks may be freed or reused. Unknown ids are True."""
        self._drain()
        send = self.send_sessions.get(request_id)
        if send is not None:
            self._poll_writes(send)
            if send.writes:
                return False
            del self.send_sessions[request_id]
            self._remember_closed(request_id)
            # Requesters still waiting for chunks would otherwise wait out their timeout.
            for peer in set(send.targets) | set(send.refuse_after_writes):
                self._refuse(peer, request_id, "the context side cancelled this request")
            return True
        recv = self.recv_sessions.get(request_id)
        if recv is None:
            self._early.pop(request_id, None)
            self._early_deadline.pop(request_id, None)
            self._remember_closed(request_id)
            return True
        if recv.held:  # never asked for: nothing can be written, but the context side may hold its KV
            self._close_recv(self.recv_sessions.pop(request_id))
            for endpoint in recv.all_ctx.values():
                self._messenger.send(endpoint, Cancel(request_id, self._own.key))
            return True
        if len(recv.done) == len(recv.writers):
            self._close_recv(self.recv_sessions.pop(request_id))
            return True
        if not recv.cancel_sent:
            recv.cancel_sent = True
            for endpoint in recv.all_ctx.values():
                self._messenger.send(endpoint, Cancel(request_id, self._own.key))
        if recv.settled:
            self._close_recv(self.recv_sessions.pop(request_id))
            return True
        return False

    # -- internals: listener thread -----------------------------------------------------------
    def _on_message(self, message: Message) -> Message | None:
        if isinstance(message, RankInfoRequest):
            return self._instance_reply  # None before start(): the asker times out with a clear error
        self._events.put(message)
        self._wake.set()
        return None

    # -- internals: executor thread -----------------------------------------------------------
    def _require_started(self) -> RankInfo:
        if self._own is None:
            raise KVTransferError("KVTransceiver.start(rank_info, instance_ranks) must be called first")
        return self._own

    def _deadline(self) -> float:
        return time.monotonic() + self.config.kv_transfer_timeout_ms / 1000.0

    def fetch_instance(self, endpoint: str) -> list[bytes]:
        """The RankInfos (as bytes) of the context instance at `endpoint`, asked over the network.
        Safe from any thread, so an executor can fetch a new peer without stalling its step loop,
        then hand the answer to every rank through `add_instance`. Raises TimeoutError when nothing
        answers within rank_info_timeout_s."""
        own = self._require_started()
        reply = self._messenger.request(endpoint, RankInfoRequest(own.key), self.config.rank_info_timeout_s)
        if not isinstance(reply, RankInfoReply) or not reply.rank_infos:
            raise KVTransferError(f"context endpoint {endpoint} answered {reply.TYPE.name}, not its RankInfos")
        return list(reply.rank_infos)

    def add_instance(self, endpoint: str, rank_infos: Sequence[bytes]) -> None:
        """Cache a context instance's RankInfos (from `fetch_instance`), so no request pays the round trip."""
        if endpoint not in self._ctx_instances:
            self._ctx_instances[endpoint] = tuple(RankInfo.from_bytes(b) for b in rank_infos)

    def forget_instance(self, endpoint: str) -> None:
        """Drop a cached context instance (e.g. after a failure: it may have restarted, so the next
        contact runs the canary again)."""
        for info in self._ctx_instances.pop(endpoint, ()):
            self._registered_with.discard(info.key)
        gate = self._gates.get(endpoint)
        if gate is not None and gate.passed:
            del self._gates[endpoint]

    def _ctx_ranks(self, endpoint: str) -> tuple[RankInfo, ...]:
        cached = self._ctx_instances.get(endpoint)
        if cached is None:
            self.add_instance(endpoint, self.fetch_instance(endpoint))
            cached = self._ctx_instances[endpoint]
        for ctx in cached:
            if ctx.key not in self._registered_with:
                self._messenger.send(ctx.control_endpoint, RegisterPeer(self._own.to_bytes()))
                self._registered_with.add(ctx.key)
        return cached

    # -- internals: first-contact canary (generation side) ---------------------------------------
    def _gate(self, endpoint: str, ctx_ranks: tuple[RankInfo, ...]) -> canary.Gate | None:
        """The canary a request to `endpoint` must wait for, or None once the pair passed (or is not checked)."""
        gate = self._gates.get(endpoint)
        if gate is None:
            tokens = canary.canary_tokens(ctx_ranks[0], self._own)
            gate = self._gates[endpoint] = canary.Gate(
                endpoint, canary.canary_request_id(self._own.instance_name, endpoint), tokens, ctx_ranks,
                passed=tokens == 0)
            if not tokens:
                logger.info("%s: KV from %s is not checked by a first-contact canary (a side reserved no canary "
                            "blocks: device memory or the canary off; or context parallelism)", self._own.key, endpoint)
        return None if gate.passed else gate

    def _start_canary(self) -> None:
        """Start the next waiting canary, unless one is running (they share our canary blocks)."""
        gates = self._gates.values()
        if any(g.started and not g.passed for g in gates):
            return
        gate = next((g for g in gates if not g.started and not g.passed), None)
        if gate is None:
            return
        own, gate.started = self._own, True
        ids = canary.canary_block_ids(own, gate.num_tokens)
        canary.zero(own, ids, gate.num_tokens)  # what an earlier canary left must not pass for this one
        by_rank = {r.rank: r for r in gate.ctx_ranks}
        self.recv_sessions[gate.request_id] = RecvSession(
            gate.request_id, writers={by_rank[w].key: by_rank[w].control_endpoint
                                      for w in writers_for(own, gate.ctx_ranks)},
            all_ctx={r.key: r.control_endpoint for r in gate.ctx_ranks}, deadline=self._deadline(), block_ids=ids)
        requesters = sum(1 for r in self._instance if r.dp_rank == own.dp_rank)
        for ctx in gate.ctx_ranks:
            self._messenger.send(ctx.control_endpoint, RequestData(
                gate.request_id, own.key, ids, (0, gate.num_tokens), requesters, canary=True))

    def _settle_canaries(self) -> None:
        for gate in [g for g in self._gates.values() if g.started and not g.passed]:
            session = self.recv_sessions[gate.request_id]
            status = session.local_status()
            if status == TransferStatus.IN_PROGRESS:
                continue
            self._close_recv(self.recv_sessions.pop(gate.request_id))
            if status == TransferStatus.DONE:
                problem = canary.check(self._own, session.block_ids, gate.num_tokens)
            else:
                problem = session.error_text()
                for endpoint in session.all_ctx.values():
                    self._messenger.send(endpoint, Cancel(gate.request_id, self._own.key))
            self._open_gate(gate, problem)
        self._start_canary()

    def _open_gate(self, gate: canary.Gate, problem: str | None) -> None:
        """Send the held requests once the canary passed; refuse them (and forget the peer) if it failed."""
        held = [s for s in map(self.recv_sessions.get, gate.held) if s is not None and s.held]
        gate.held = []
        if problem is None:
            gate.passed = True
            logger.info("%s: first-contact canary with %s passed (%d tokens)", self._own.key, gate.endpoint,
                        gate.num_tokens)
            for session in held:
                messages, session.held = session.held, []
                try:
                    for endpoint, message in messages:
                        self._messenger.send(endpoint, message)
                except KVTransferError as exc:
                    session.refused = str(exc)
            return
        reason = (f"the first-contact canary with the context instance at {gate.endpoint} failed: {problem}. The "
                  "two instances disagree on where KV bytes go, or the transport moved them wrongly; no KV is taken "
                  "from it until a new first contact passes")
        logger.error("%s: %s", self._own.key, reason)
        for session in held:
            session.held, session.refused = [], reason
        del self._gates[gate.endpoint]
        self.forget_instance(gate.endpoint)

    def _check(self, table: dict, at_least: int, step: Callable[[], TransferResults]) -> TransferResults:
        want = min(max(at_least, 0), sum(1 for rid in table if not canary.is_canary(rid)))
        self._wake.clear()  # before the step, which drains the queue: no wake-up is lost
        results = step()
        while len(results) < want:
            self._wake.wait(POLL_INTERVAL_S)
            self._wake.clear()
            more = step()
            results.merge(more)
        return results

    def _drain(self) -> None:
        """Apply queued control messages and agent notifications to the session tables."""
        while True:
            try:
                message = self._events.get_nowait()
            except queue.Empty:
                break
            try:
                self._apply(message)
            except Exception:
                logger.exception("%s: failed to apply %s", self._own and self._own.key, message.TYPE.name)
        for sender, payload in self.agent.get_notifications():
            try:
                done = decode(payload)
            except ProtocolError as exc:
                logger.warning("dropped a malformed transfer notification from %s: %s", sender, exc)
                continue
            if not isinstance(done, TransferDone):
                logger.warning("dropped a %s sent as a transfer notification by %s", done.TYPE.name, sender)
                continue
            session = self.recv_sessions.get(done.request_id)
            if session is None:  # normal after a cancel or timeout: its writes were already in flight
                logger.info("%s: dropped the notification of a write for request %d from %s, which has no "
                            "receive session here (cancelled, timed out or done)", self._own.key, done.request_id,
                            done.sender)
                continue
            if done.sender not in session.writers:
                logger.warning("%s: dropped a notification for request %d from %s, which is not one of its "
                               "writers", self._own.key, done.request_id, done.sender)
                continue
            if done.bounced and not self._unbounce(session, done):
                continue
            if session.checksum or done.digests:
                problem = self._verify(session, done)
                if problem is not None:
                    logger.error("%s: request %d from %s: %s", self._own.key, done.request_id, done.sender, problem)
                    session.corrupted.setdefault(done.sender, problem)
            session.on_chunk(done.sender, done.chunk, done.last, done.token_range, done.state)
            session.deadline = self._deadline()  # chunks still arriving: not stalled

    def _apply(self, message: Message) -> None:
        if isinstance(message, RegisterPeer):
            info = RankInfo.from_bytes(message.rank_info)
            self._gen_peers[info.key] = info
        elif isinstance(message, RequestData):
            if message.canary:
                self._serve_canary(message)
            elif message.request_id in self.send_sessions:
                self._serve(message)
            elif message.request_id in self._closed_sends:
                self._refuse(message.sender, message.request_id, "the context side cancelled this request")
            else:
                self._early.setdefault(message.request_id, []).append(message)
                self._early_deadline.setdefault(message.request_id, self._deadline())
        elif isinstance(message, Cancel):
            self._on_cancel(message)
        elif isinstance(message, TransferError):
            session = self.recv_sessions.get(message.request_id)
            if session is not None:
                session.errors[message.sender] = message.reason
        else:
            logger.warning("%s: unexpected control message %s", self._own.key, message.TYPE.name)

    def _on_cancel(self, message: Cancel) -> None:
        early = self._early.get(message.request_id, [])
        self._early[message.request_id] = [r for r in early if r.sender != message.sender]
        if not self._early[message.request_id]:
            del self._early[message.request_id]
            self._early_deadline.pop(message.request_id, None)
        session = self.send_sessions.get(message.request_id)
        if session is None:
            # The generation side gave up before we offered the KV: fail the offer as soon as it comes.
            self._cancelled_early[message.request_id] = f"generation rank {message.sender} cancelled"
            while len(self._cancelled_early) > _REMEMBER_CLOSED:
                self._cancelled_early.popitem(last=False)
        if session is not None and message.sender not in session.served:
            # It gets no further write (pending chunks of a pipelined send are dropped).
            session.served.add(message.sender)
            session.targets.pop(message.sender, None)
            session.error = session.error or f"generation rank {message.sender} cancelled"
        if session is not None and session.writing_to(message.sender):
            # Tell it only once the writes in flight landed: it must not reuse blocks before.
            session.refuse_after_writes[message.sender] = "cancelled"
            return
        gen = self._gen_peers.get(message.sender)
        if gen is not None:
            self._messenger.send(gen.control_endpoint, TransferError(message.request_id, self._own.key, "cancelled"))

    def _refuse(self, requester: PeerKey, request_id: int, reason: str) -> None:
        gen = self._gen_peers.get(requester)
        if gen is None:
            logger.warning("%s: cannot refuse request %d of unregistered %s", self._own.key, request_id, requester)
            return
        self._messenger.send(gen.control_endpoint, TransferError(request_id, self._own.key, reason))

    def _serve_canary(self, request: RequestData) -> None:
        """Fill our canary blocks with the pattern and offer them to the asking generation rank."""
        rid, tokens = request.request_id, request.token_range[1]
        if rid not in self.send_sessions:
            try:
                if not canary.is_canary(rid):
                    raise ValueError(f"request id {rid} is not a canary id")
                ids = canary.canary_block_ids(self._own, tokens)
            except ValueError as exc:
                self._refuse(request.sender, rid, f"cannot serve the first-contact canary: {exc}")
                return
            self._closed_sends.pop(rid, None)  # an earlier canary of the same pair ended: this is a new one
            self._cancelled_early.pop(rid, None)
            canary.fill(self._own, ids, tokens)
            self.respond_and_send_async(rid, ids, token_range=(0, tokens))
        self._serve(request)

    def _serve(self, request: RequestData) -> None:
        """Take one requester's REQUEST_DATA and write it every chunk offered so far (context side)."""
        session = self.send_sessions[request.request_id]
        session.num_requesters = request.num_requesters
        if request.sender in session.served or request.sender in session.targets:
            return
        gen = self._gen_peers.get(request.sender)
        if gen is None:
            session.served.add(request.sender)
            session.error = f"REQUEST_DATA from {request.sender} before its REGISTER_PEER"
            logger.warning("%s: %s", self._own.key, session.error)
            return
        my_group = tuple(r for r in self._instance if r.dp_rank == self._own.dp_rank)
        if self._own.rank not in writers_for(gen, my_group):
            session.served.add(request.sender)
            return
        session.targets[gen.key] = request
        self._write_pending(session, gen)

    def _write_pending(self, session: SendSession, gen: RankInfo) -> None:
        """Submit one write per chunk not yet sent to `gen`; the last one serves it."""
        request: RequestData = session.targets[gen.key]
        while session.sent.get(gen.key, 0) < len(session.chunks):
            index = session.sent.get(gen.key, 0)
            chunk = session.chunks[index]
            try:
                self._write_chunk(session, request, gen, index, chunk)
            except KVTransferError as exc:
                lease = session.staging.pop((gen.key, index), None)
                if lease is not None:
                    self._staging.release(lease)
                session.error = f"request {request.request_id} to {gen.key}: {exc}"
                logger.error("%s: %s", self._own.key, session.error)
                session.targets.pop(gen.key)
                session.served.add(gen.key)
                if session.writing_to(gen.key):
                    session.refuse_after_writes[gen.key] = str(exc)
                else:
                    self._refuse(gen.key, request.request_id, str(exc))
                return
            session.sent[gen.key] = index + 1
            if chunk.last:
                del session.targets[gen.key]
                session.served.add(gen.key)

    def _write_chunk(self, session: SendSession, request: RequestData, gen: RankInfo, index: int,
                     chunk: SendChunk) -> None:
        t0 = time.perf_counter()
        plan = plan_write(self._own, gen, chunk.block_ids, request.block_ids)
        self.stage_seconds["plan"] += time.perf_counter() - t0
        remote = self._loaded_agents.get(gen.key)
        if remote is None:
            remote = self._loaded_agents[gen.key] = self.agent.load_remote(gen.agent_descriptor)
        if plan is None:
            src = dst = sizes = np.zeros(0, np.uint64)
        else:
            src, dst, sizes = plan.src_ptrs, plan.dst_ptrs, plan.sizes
        src_ids, digests = {}, b""
        if request.checksum or self.config.checksum:
            if any(r.is_device for r in self.agent.registered_regions):
                raise KVTransferError("the receiver asked for KV checksums, which need host memory; this context "
                                      "rank's KV is in device memory (turn cache_transceiver_config.checksum off)")
            t0 = time.perf_counter()
            src_ids, digests = chunk.block_ids, to_wire(block_digests(src, dst, sizes, gen.page_table.pools)[1])
            self.stage_seconds["checksum"] += time.perf_counter() - t0
        # The receiver's staging segment holds one write per writer: only a one-chunk send bounces.
        bounced = self._bounce(session, request, gen, src, dst, sizes) if index == 0 and chunk.last else None
        if bounced is not None:
            src, dst, sizes = bounced
        note = TransferDone(request.request_id, self._own.key, int(np.sum(sizes, dtype=np.uint64)),
                            bounced is not None, index, chunk.last, chunk.token_range,
                            chunk.state if chunk.last else b"", src_ids, digests)
        t0 = time.perf_counter()
        session.writes[(gen.key, index)] = self.agent.submit_write(remote, src, dst, sizes, note.to_bytes())
        self.stage_seconds["submit"] += time.perf_counter() - t0
        if canary.is_canary(request.request_id):
            self.canary_writes += 1
            return
        self.stats["bounced_writes" if bounced is not None else "direct_writes"] += 1
        self.stats["fragments_written"] += len(sizes)
        self.stats["bytes_written"] += note.num_bytes

    def _verify(self, session: RecvSession, done: TransferDone) -> str | None:
        """Digest what `done`'s write left in our blocks; None when it matches what the sender sent."""
        if any(r.is_device for r in self.agent.registered_regions):
            return (f"write {done.chunk} came with KV checksums, which need host memory; this rank's KV is in "
                    "device memory (turn cache_transceiver_config.checksum off on the context instance)")
        t0 = time.perf_counter()
        try:
            if not done.src_block_ids:
                return f"write {done.chunk} came without KV checksums, which this rank asked for"
            plan = plan_write(session.writer_infos[done.sender], self._own, done.src_block_ids, session.block_ids)
            if plan is None:
                return f"write {done.chunk} came from a rank that writes nothing here"
            keys, ours = block_digests(plan.dst_ptrs, plan.dst_ptrs, plan.sizes, self._own.page_table.pools)
            problem = first_mismatch(keys, ours, done.digests)
            return None if problem is None else f"write {done.chunk}: {problem}"
        except (KVTransferError, ValueError) as exc:
            return f"write {done.chunk}: cannot check its KV checksums: {exc}"
        finally:
            self.stage_seconds["checksum"] += time.perf_counter() - t0

    def _poll_writes(self, session: SendSession) -> None:
        for key, handle in list(session.writes.items()):
            state = self.agent.poll(handle)
            if state is TransferState.IN_PROGRESS:
                continue
            self.agent.release(handle)
            del session.writes[key]
            lease = session.staging.pop(key, None)
            if lease is not None:
                self._staging.release(lease)
            peer = key[0]
            if state is TransferState.FAILED:
                session.error = f"write of request {session.request_id} to {peer} failed"
                session.targets.pop(peer, None)
                session.served.add(peer)
                session.refuse_after_writes.setdefault(peer, "the context side's write failed")
            if peer in session.refuse_after_writes and not session.writing_to(peer):
                self._refuse(peer, session.request_id, session.refuse_after_writes.pop(peer))

    def poll_control(self) -> None:
        """Context side with no send session: apply what peers sent meanwhile (REQUEST_DATA that came
        before our offer, CANCELs), and refuse parked requests that waited kv_transfer_timeout_ms."""
        self._drain()
        self._expire_early()

    @property
    def control_pending(self) -> bool:
        """Whether `poll_control` has anything to do."""
        return not self._events.empty() or bool(self._early)

    def _expire_early(self) -> None:
        now = time.monotonic()
        for rid in [r for r, t in self._early_deadline.items() if now > t]:
            del self._early_deadline[rid]
            for request in self._early.pop(rid, []):
                self._refuse(request.sender, rid, f"the context instance got no request {rid} within "
                                                  f"kv_transfer_timeout_ms={self.config.kv_transfer_timeout_ms} (its "
                                                  "prefill failed, was cancelled or never arrived)")

    def _step_send(self) -> TransferResults:
        self._drain()
        self._expire_early()
        ids = sorted(self.send_sessions)
        for rid in ids:
            self._poll_writes(self.send_sessions[rid])
        local = np.array([self.send_sessions[r].local_status() for r in ids], dtype=np.int64)
        results = self._finish(self.send_sessions, ids, local, lambda s: s.error)
        for rid in results.failed:
            self._remember_closed(rid)  # late REQUEST_DATA for it is refused, not parked forever
        # Canary sends are ours alone: the executor never offered them.
        results.completed = [rid for rid in results.completed if not canary.is_canary(rid)]
        for rid in [rid for rid in results.failed if canary.is_canary(rid)]:
            logger.warning("%s: a first-contact canary send failed: %s", self._own.key, results.failed.pop(rid))
        return results

    def _step_recv(self) -> TransferResults:
        self._drain()
        self._settle_canaries()
        sessions = {rid: s for rid, s in self.recv_sessions.items() if not canary.is_canary(rid)}
        ids = sorted(sessions)
        local = np.array([sessions[r].local_status() for r in ids], dtype=np.int64)
        results = self._finish(self.recv_sessions, ids, local, lambda s: s.error_text())
        for rid in results.failed:
            if not sessions[rid].cancel_sent:
                # Abandoned: the context ranks drop work they have not started for it.
                for endpoint in sessions[rid].all_ctx.values():
                    self._messenger.send(endpoint, Cancel(rid, self._own.key))
        return results

    def _finish(self, table: dict, ids: list[int], local: np.ndarray, reason) -> TransferResults:
        results = TransferResults()
        if not ids:
            return results
        for rid, state in zip(ids, local.tolist()):
            if state == TransferStatus.DONE:
                session = table.pop(rid)
                results.completed.append(rid)
                if table is self.recv_sessions:
                    if session.tokens:
                        results.tokens[rid] = session.tokens
                    if session.state:
                        results.states[rid] = session.state
            elif state == TransferStatus.FAILED:
                session = table.pop(rid)
                results.failed[rid] = reason(session)
            if state != TransferStatus.IN_PROGRESS and table is self.recv_sessions:
                self._close_recv(session)
        return results

    def _remember_closed(self, request_id: int) -> None:
        self._closed_sends[request_id] = None
        while len(self._closed_sends) > _REMEMBER_CLOSED:
            self._closed_sends.popitem(last=False)

    # -- internals: bounce buffer -------------------------------------------------------------
    def _bounce_offer(self, session: RecvSession, ids: dict[int, np.ndarray]) -> dict | None:
        """Lease one staging segment per writer when the request is big enough to maybe bounce."""
        cfg = self.config.bounce
        num_blocks = sum(int((b >= 0).sum()) for b in ids.values())
        if cfg is None or num_blocks < cfg.min_kv_blocks or not session.writers:
            return None
        table = self._own.page_table
        payload = sum(int((ids.get(g.group_id, np.zeros(0)) >= 0).sum()) * table.pools[v.pool_index].slot_bytes
                      for g in table.layer_groups for v in g.views)
        slot = segment_bound(payload)
        writers = tuple(sorted(k[1] for k in session.writers))
        lease = self._staging.lease(slot * len(writers))
        if lease is None:
            logger.warning("%s: staging buffer full, request %d goes direct", self._own.key, session.request_id)
            return None
        session.staging, session.bounce_slot, session.bounce_writers = lease, slot, writers
        return {"params": cfg.to_dict(), "ptr": lease.ptr, "slot": slot, "writers": list(writers)}

    def _bounce(self, session: SendSession, request: RequestData, gen: RankInfo, src, dst, sizes):
        """Gather into our staging and return the single (src, dst, size) write, or None for direct."""
        offer, cfg = request.bounce, self.config.bounce
        if offer is None or len(sizes) == 0:
            return None
        if cfg is None or offer.get("params") != cfg.to_dict():
            logger.warning("%s: bounce parameters differ from %s's (%s vs %s); request %d goes direct",
                           self._own.key, gen.key, cfg and cfg.to_dict(), offer.get("params"), request.request_id)
            return None
        num_blocks = sum(int((b >= 0).sum()) for b in request.block_ids.values())
        if not cfg.kv_passes(num_blocks, sizes):
            return None
        need = plan_segment_bytes(sizes)
        if need > offer["slot"] or self._own.rank not in offer["writers"]:
            logger.warning("%s: bounce segment of %d bytes does not fit %s's %d; request %d goes direct",
                           self._own.key, need, gen.key, offer["slot"], request.request_id)
            return None
        lease = self._staging.lease(need)
        if lease is None:
            return None
        t0 = time.perf_counter()
        total = gather(lease, src, dst, sizes)
        self.stage_seconds["gather"] += time.perf_counter() - t0
        session.staging[(gen.key, 0)] = lease
        target = offer["ptr"] + offer["writers"].index(self._own.rank) * offer["slot"]
        return (np.array([lease.ptr], np.uint64), np.array([target], np.uint64), np.array([total], np.uint64))

    def _unbounce(self, session: RecvSession, done: TransferDone) -> bool:
        try:
            if session.staging is None or done.sender[1] not in session.bounce_writers:
                raise KVTransferError(f"{done.sender} bounced request {done.request_id} but we offered no segment")
            index = session.bounce_writers.index(done.sender[1])
            kv_regions = RegionTable([r for r in self.agent.registered_regions if r != self._staging.region])
            t0 = time.perf_counter()
            scatter(session.staging.ptr + index * session.bounce_slot, session.bounce_slot, kv_regions)
            self.stage_seconds["scatter"] += time.perf_counter() - t0
            return True
        except KVTransferError as exc:
            session.errors[done.sender] = str(exc)
            return False

    def _close_recv(self, session: RecvSession) -> None:
        """Return the session's staging lease; quarantine it if a writer may still write into it."""
        if session.staging is None:
            return
        if session.settled:
            self._staging.release(session.staging)
        else:
            logger.warning("%s: request %d ended with writers unsettled; %d staging bytes quarantined",
                           self._own.key, session.request_id, session.staging.nbytes)
        session.staging = None
