"""The context rank's side of the transceiver: send sessions (see sessions.py for their lifecycle).

    respond_and_send_async ──> a chunk of KV offered ──> written to every requester whose
                                                         REQUEST_DATA is here
    REQUEST_DATA ──> a requester ──> written every chunk offered so far (parked when it comes
                                     before our offer and says it may wait, refused once
                                     kv_transfer_timeout_ms passed; answered UNKNOWN_REQUEST at once
                                     when it may not wait)
    CANCEL       ──> that requester gets nothing more; told so once its writes in flight landed

All address arithmetic of a transfer happens here (`write_plan.plan_write`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Mapping

import numpy as np

from pdserve.kv_transfer import canary
from pdserve.kv_transfer.agents.base import TransferState
from pdserve.kv_transfer.control.messages import (Cancel, PeerKey, RequestData, TransferDone, TransferError,
                                                  UnknownRequest)
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.integrity import block_digests, to_wire
from pdserve.kv_transfer.rank_info import RankInfo
from pdserve.kv_transfer.write_plan import plan_write, writers_for
from pdserve.kv_transfer.sessions import SendChunk, SendSession, TransferResults, TransferStatus
from pdserve.kv_transfer.transceiver.base import REMEMBER_CLOSED, Local
from pdserve.kv_transfer.transceiver.bouncer import Bouncer
from pdserve.kv_transfer.transceiver.control_plane import ControlPlane

logger = logging.getLogger(__name__)


class Sender:
    def __init__(self, local: Local, control: ControlPlane, bouncer: Bouncer) -> None:
        self._local, self._control, self._bouncer = local, control, bouncer
        self.sessions: dict[int, SendSession] = {}
        self.gen_peers: dict[PeerKey, RankInfo] = {}  # generation ranks that registered with us
        self._loaded_agents: dict[PeerKey, str] = {}
        self.early: dict[int, list[RequestData]] = {}  # REQUEST_DATA before our offer, by request id
        self._early_deadline: dict[int, float] = {}  # ... refused once kv_transfer_timeout_ms passed
        self._cancelled_early: OrderedDict[int, str] = OrderedDict()  # CANCEL before our offer
        self._closed: OrderedDict[int, None] = OrderedDict()  # ended sends, to refuse their late messages
        self.canary_writes = 0  # first-contact canaries this rank wrote (kept out of the requests' stats)
        # Sessions this rank started for a canary REQUEST_DATA: the executor never offered them, so their
        # end is not reported to it. Known by how they began, never by their id's range: an id of an
        # offered request is reported whatever its value, or its KV would be held until the process dies.
        self.canaries: set[int] = set()

    # -- the executor's calls -----------------------------------------------------------------
    def respond_and_send_async(self, disagg_id: int, block_ids: Mapping[int, np.ndarray],
                               token_range: tuple[int, int], last: bool, state: bytes) -> None:
        own = self._local.require_started()
        session = self.sessions.get(disagg_id)
        if session is not None and session.offered_all:
            raise KVTransferError(f"request {disagg_id} is already being sent by {own.key}")
        if session is not None and session.error is not None:
            return  # failed (e.g. cancelled) and waiting for its writes to settle: nothing more to offer
        early: list[RequestData] = []
        if session is None and token_range[0] > 0 and disagg_id in self._closed:
            # A later chunk of a send that already ended (cancelled, failed): drop it, park nothing.
            logger.debug("%s: dropped a chunk of ended request %d", own.key, disagg_id)
            return
        if session is None:
            self._closed.pop(disagg_id, None)
            session = self.sessions[disagg_id] = SendSession(
                disagg_id, self._local.deadline(), error=self._cancelled_early.pop(disagg_id, None))
            early = self.early.pop(disagg_id, [])
            self._early_deadline.pop(disagg_id, None)
        session.deadline = self._local.deadline()  # a long pipelined prefill is not a stalled transfer
        ids = {int(g): np.asarray(b, dtype=np.int64) for g, b in block_ids.items()}
        session.chunks.append(SendChunk(ids, (int(token_range[0]), int(token_range[1])), bool(last), bytes(state)))
        for key in list(session.targets):
            self._write_pending(session, self.gen_peers[key])
        for request in early:
            self._serve(request)

    def step(self) -> TransferResults:
        """Expire parked requests, poll the writes, and take the sessions that ended out of the table."""
        self.expire_early()
        ids = sorted(self.sessions)
        for rid in ids:
            self._poll_writes(self.sessions[rid])
        results = TransferResults()
        for rid, status in [(rid, self.sessions[rid].local_status()) for rid in ids]:
            if status == TransferStatus.DONE:
                self.sessions.pop(rid)
                results.completed.append(rid)
            elif status == TransferStatus.FAILED:
                results.failed[rid] = self.sessions.pop(rid).error
                self._remember_closed(rid)  # late REQUEST_DATA for it is refused, not parked forever
        # Canary sends are ours alone: the executor never offered them.
        for rid in [rid for rid in results.completed if rid in self.canaries]:
            results.completed.remove(rid)
            self.canaries.discard(rid)
        for rid in [rid for rid in results.failed if rid in self.canaries]:
            self.canaries.discard(rid)
            logger.warning("%s: a first-contact canary send failed: %s", self._local.key, results.failed.pop(rid))
        return results

    def poll_writes(self) -> int:
        """Poll every write in flight (a NIXL write's notification leaves when it is polled DONE); how
        many finished. The sessions stay in the table for the next step to report."""
        before = sum(len(s.writes) for s in self.sessions.values())
        for session in list(self.sessions.values()):
            self._poll_writes(session)
        return before - sum(len(s.writes) for s in self.sessions.values())

    def cancel(self, disagg_id: int) -> bool:
        """False while a write of this send may still land; True once it is gone."""
        send = self.sessions[disagg_id]
        self._poll_writes(send)
        if send.writes:
            return False
        del self.sessions[disagg_id]
        self.canaries.discard(disagg_id)
        self._remember_closed(disagg_id)
        # Requesters still waiting for chunks would otherwise wait out their timeout.
        for peer in set(send.targets) | set(send.refuse_after_writes):
            self._refuse(peer, disagg_id, "the context side cancelled this request")
        return True

    def forget(self, disagg_id: int) -> None:
        """A request this rank sends nothing of (any more): drop what it parked, refuse what comes late."""
        self.early.pop(disagg_id, None)
        self._early_deadline.pop(disagg_id, None)
        self._remember_closed(disagg_id)

    def expire_early(self) -> None:
        now = time.monotonic()
        for rid in [r for r, t in self._early_deadline.items() if now > t]:
            del self._early_deadline[rid]
            for request in self.early.pop(rid, []):
                self._refuse(request.sender, rid, f"the context instance got no request {rid} within "
                                                  f"kv_transfer_timeout_ms={self._local.config.kv_transfer_timeout_ms}"
                                                  " (its prefill failed, was cancelled or never arrived)")

    # -- control messages (ControlPlane.drain) ------------------------------------------------
    def add_peer(self, info: RankInfo) -> None:
        self.gen_peers[info.key] = info

    def on_request_data(self, message: RequestData) -> None:
        if message.canary:
            self._serve_canary(message)
        elif message.disagg_id in self.sessions:
            self._serve(message)
        elif not message.wait_for_offer:
            # The generation side asks only after our answer (context_first), which came after the offer:
            # a request we hold no session of is one we never had, or whose send ended.
            ended = message.disagg_id in self._closed
            self._unknown(message.sender, message.disagg_id,
                          "its KV was already sent, released or timed out" if ended else "it never arrived here")
        elif message.disagg_id in self._closed:
            self._refuse(message.sender, message.disagg_id, "the context side cancelled this request")
        else:
            self.early.setdefault(message.disagg_id, []).append(message)
            self._early_deadline.setdefault(message.disagg_id, self._local.deadline())

    def on_cancel(self, message: Cancel) -> None:
        early = self.early.get(message.disagg_id, [])
        self.early[message.disagg_id] = [r for r in early if r.sender != message.sender]
        if not self.early[message.disagg_id]:
            del self.early[message.disagg_id]
            self._early_deadline.pop(message.disagg_id, None)
        session = self.sessions.get(message.disagg_id)
        if session is None:
            # The generation side gave up before we offered the KV: fail the offer as soon as it comes.
            self._cancelled_early[message.disagg_id] = f"generation rank {message.sender} cancelled"
            while len(self._cancelled_early) > REMEMBER_CLOSED:
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
        gen = self.gen_peers.get(message.sender)
        if gen is not None:
            self._control.send(gen.control_endpoint,
                               TransferError(message.disagg_id, self._local.own.key, "cancelled"))

    # -- internals ----------------------------------------------------------------------------
    def _remember_closed(self, disagg_id: int) -> None:
        self._closed[disagg_id] = None
        while len(self._closed) > REMEMBER_CLOSED:
            self._closed.popitem(last=False)

    def _refuse(self, requester: PeerKey, disagg_id: int, reason: str) -> None:
        own = self._local.own
        gen = self.gen_peers.get(requester)
        if gen is None:
            logger.warning("%s: cannot refuse request %d of unregistered %s", own.key, disagg_id, requester)
            return
        self._control.send(gen.control_endpoint, TransferError(disagg_id, own.key, reason))

    def _unknown(self, requester: PeerKey, disagg_id: int, why: str) -> None:
        gen = self.gen_peers.get(requester)
        if gen is None:
            logger.warning("%s: cannot answer request %d of unregistered %s", self._local.own.key, disagg_id,
                           requester)
            return
        self._control.send(gen.control_endpoint, UnknownRequest(
            disagg_id, self._local.own.key, f"the context instance holds no request {disagg_id}: {why}"))

    def _serve_canary(self, request: RequestData) -> None:
        """Fill our canary blocks with the pattern and offer them to the asking generation rank."""
        rid, tokens = request.disagg_id, request.token_range[1]
        if rid not in self.sessions:
            try:
                if not canary.is_canary(rid):
                    raise ValueError(f"request id {rid} is not a canary id")
                ids = canary.canary_block_ids(self._local.own, tokens)
            except ValueError as exc:
                self._refuse(request.sender, rid, f"cannot serve the first-contact canary: {exc}")
                return
            self._closed.pop(rid, None)  # an earlier canary of the same pair ended: this is a new one
            self._cancelled_early.pop(rid, None)
            canary.fill(self._local.own, ids, tokens)
            self.canaries.add(rid)
            self.respond_and_send_async(rid, ids, (0, tokens), True, b"")
        self._serve(request)

    def _serve(self, request: RequestData) -> None:
        """Take one requester's REQUEST_DATA and write it every chunk offered so far."""
        own = self._local.own
        session = self.sessions[request.disagg_id]
        session.num_requesters = request.num_requesters
        if request.sender in session.served or request.sender in session.targets:
            return
        gen = self.gen_peers.get(request.sender)
        if gen is None:
            session.served.add(request.sender)
            session.error = f"REQUEST_DATA from {request.sender} before its REGISTER_PEER"
            logger.warning("%s: %s", own.key, session.error)
            return
        if own.rank not in writers_for(gen, self._local.dp_group()):
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
                    self._bouncer.release(lease)
                session.error = f"request {request.disagg_id} to {gen.key}: {exc}"
                logger.error("%s: %s", self._local.key, session.error)
                session.targets.pop(gen.key)
                session.served.add(gen.key)
                if session.writing_to(gen.key):
                    session.refuse_after_writes[gen.key] = str(exc)
                else:
                    self._refuse(gen.key, request.disagg_id, str(exc))
                return
            session.sent[gen.key] = index + 1
            if chunk.last:
                del session.targets[gen.key]
                session.served.add(gen.key)

    def _write_chunk(self, session: SendSession, request: RequestData, gen: RankInfo, index: int,
                     chunk: SendChunk) -> None:
        local, own, agent = self._local, self._local.own, self._local.agent
        with local.timed("plan"):
            plan = plan_write(own, gen, chunk.block_ids, request.block_ids)
        remote = self._loaded_agents.get(gen.key)
        if remote is None:
            remote = self._loaded_agents[gen.key] = agent.load_remote(gen.agent_descriptor)
        if plan is None:
            src = dst = sizes = np.zeros(0, np.uint64)
        else:
            src, dst, sizes = plan.src_ptrs, plan.dst_ptrs, plan.sizes
        src_ids, digests = {}, b""
        if request.checksum or local.config.checksum:
            if local.kv_on_device():
                raise KVTransferError("the receiver asked for KV checksums, which need host memory; this context "
                                      "rank's KV is in device memory (turn cache_transceiver_config.checksum off)")
            with local.timed("checksum"):
                src_ids, digests = chunk.block_ids, to_wire(block_digests(src, dst, sizes, gen.page_table.pools)[1])
        # The receiver's staging segment holds one write per writer: only a one-chunk send bounces.
        bounced = self._bouncer.gather(session, request, gen, src, dst, sizes) if index == 0 and chunk.last else None
        if bounced is not None:
            src, dst, sizes = bounced
        note = TransferDone(request.disagg_id, own.key, int(np.sum(sizes, dtype=np.uint64)),
                            bounced is not None, index, chunk.last, chunk.token_range,
                            chunk.state if chunk.last else b"", src_ids, digests)
        with local.timed("submit"):
            session.writes[(gen.key, index)] = agent.submit_write(remote, src, dst, sizes, note.to_bytes())
        if request.disagg_id in self.canaries:
            self.canary_writes += 1
            return
        local.stats["bounced_writes" if bounced is not None else "direct_writes"] += 1
        local.stats["fragments_written"] += len(sizes)
        local.stats["bytes_written"] += note.num_bytes

    def _poll_writes(self, session: SendSession) -> None:
        agent = self._local.agent
        for key, handle in list(session.writes.items()):
            state = agent.poll(handle)
            if state is TransferState.IN_PROGRESS:
                continue
            agent.release(handle)
            del session.writes[key]
            lease = session.staging.pop(key, None)
            if lease is not None:
                self._bouncer.release(lease)
            peer = key[0]
            if state is TransferState.FAILED:
                session.error = f"write of request {session.disagg_id} to {peer} failed"
                session.targets.pop(peer, None)
                session.served.add(peer)
                session.refuse_after_writes.setdefault(peer, "the context side's write failed")
            if peer in session.refuse_after_writes and not session.writing_to(peer):
                self._refuse(peer, session.disagg_id, session.refuse_after_writes.pop(peer))
