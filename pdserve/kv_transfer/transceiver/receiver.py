"""The generation rank's side of the transceiver: receive sessions (see sessions.py for their
lifecycle), and the first-contact canary gate in front of them.

    request_and_receive_async ──> REQUEST_DATA (our block ids, a bounce offer) to every ctx rank
                                  of the request's DP group; held while a first-contact canary
                                  with that context instance runs (canary.py), one at a time
    TRANSFER_DONE (a notification) ──> one write landed: unbounced, checked against its
                                       checksums when asked for, counted toward the writer's chunks
    TRANSFER_ERROR ──> that writer will not write
    UNKNOWN_REQUEST ──> that ctx rank holds no such request: the session fails, reported as unknown
    a writer's control endpoint without a connection for peer_lost_ms ──> that writer is lost (killed,
                                       or unreachable): its sessions fail now, not at kv_transfer_timeout_ms

The receiver plans no write: it derives only which ctx ranks will write to it
(`write_plan.writers_for`). Checking KV checksums re-runs the sender's `plan_write` to walk the
same fragments (integrity.py).
"""

from __future__ import annotations

import logging
import time
from typing import Mapping

import numpy as np

from pdserve.kv_transfer import canary
from pdserve.kv_transfer.control.messages import Cancel, RequestData, TransferDone, TransferError, UnknownRequest
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.integrity import block_digests, first_mismatch
from pdserve.kv_transfer.rank_info import RankInfo
from pdserve.kv_transfer.write_plan import plan_write, writers_for
from pdserve.kv_transfer.sessions import RecvSession, TransferResults, TransferStatus
from pdserve.kv_transfer.transceiver.base import Local
from pdserve.kv_transfer.transceiver.bouncer import Bouncer
from pdserve.kv_transfer.transceiver.control_plane import ControlPlane

logger = logging.getLogger(__name__)


class Receiver:
    def __init__(self, local: Local, control: ControlPlane, bouncer: Bouncer) -> None:
        self._local, self._control, self._bouncer = local, control, bouncer
        self.sessions: dict[int, RecvSession] = {}
        self.gates: dict[str, canary.Gate] = {}  # ctx endpoint -> first-contact canary

    # -- the executor's calls -----------------------------------------------------------------
    def request_and_receive_async(self, disagg_id: int, ctx_endpoint: str, block_ids: Mapping[int, np.ndarray],
                                  token_range: tuple[int, int], ctx_dp_rank: int, timeout_ms: float | None,
                                  wait_for_offer: bool = True) -> None:
        local = self._local
        own = local.require_started()
        if disagg_id in self.sessions:
            raise KVTransferError(f"request {disagg_id} is already being received by {own.key}")
        ctx_ranks = tuple(r for r in self._control.ctx_ranks(ctx_endpoint) if r.dp_rank == ctx_dp_rank)
        if not ctx_ranks:
            raise KVTransferError(f"context instance at {ctx_endpoint} has no DP group {ctx_dp_rank}")
        try:
            writers = set(writers_for(own, ctx_ranks))
        except KVTransferError:
            # The context ranks hold this request's KV for us: tell them now, not at their timeout.
            for ctx in ctx_ranks:
                self._control.send(ctx.control_endpoint, Cancel(disagg_id, own.key))
            raise
        by_rank = {r.rank: r for r in ctx_ranks}
        session = RecvSession(
            disagg_id,
            writers={by_rank[w].key: by_rank[w].control_endpoint for w in writers},
            all_ctx={r.key: r.control_endpoint for r in ctx_ranks},
            deadline=local.deadline() if timeout_ms is None else time.monotonic() + timeout_ms / 1000.0,
            writer_infos={by_rank[w].key: by_rank[w] for w in writers},
            checksum=local.config.checksum,
        )
        ids = session.block_ids = {int(g): np.asarray(b, dtype=np.int64) for g, b in block_ids.items()}
        offer = self._bouncer.offer(session, ids)
        # Every rank of our DP group asks every ctx rank, so each ctx rank knows when it served all.
        requesters = len(local.dp_group())
        # Registered before publishing, so a fast writer's notification always finds its session.
        self.sessions[disagg_id] = session
        messages = [(ctx.control_endpoint, RequestData(disagg_id, own.key, ids, tuple(token_range), requesters,
                                                       offer, local.config.checksum, wait_for_offer=wait_for_offer))
                    for ctx in ctx_ranks]
        gate = self._gate(ctx_endpoint, ctx_ranks)
        if gate is not None:  # first contact: asked once the canary passed
            session.held = messages
            gate.held.append(disagg_id)
            self._start_canary()
            return
        try:
            for endpoint, message in messages:
                self._control.send(endpoint, message)
        except Exception:
            self._bouncer.close_recv(self.sessions.pop(disagg_id))
            raise

    def step(self) -> TransferResults:
        """Settle the canaries, and take the sessions that ended out of the table."""
        self._mark_lost_writers()
        self._settle_canaries()
        results = TransferResults()
        ids = sorted(rid for rid in self.sessions if rid not in self.canaries)
        for rid, status in [(rid, self.sessions[rid].local_status()) for rid in ids]:
            if status == TransferStatus.IN_PROGRESS:
                continue
            session = self.sessions.pop(rid)
            if status == TransferStatus.DONE:
                results.completed.append(rid)
                if session.tokens:
                    results.tokens[rid] = session.tokens
                if session.state:
                    results.states[rid] = session.state
            else:
                results.failed[rid] = session.error_text()
                if session.unknown:
                    results.unknown.append(rid)
                if not session.cancel_sent:
                    # Abandoned: the context ranks drop work they have not started for it.
                    self._cancel_everywhere(session)
            self._bouncer.close_recv(session)
        return results

    @property
    def canaries(self) -> set[int]:
        """Ids of the canary sessions running now (ours alone: the executor never asked for them)."""
        return {g.disagg_id for g in self.gates.values() if g.started and not g.passed}

    def cancel(self, disagg_id: int) -> bool:
        """False while a writer may still write into this session's blocks; True once none can."""
        recv = self.sessions[disagg_id]
        if recv.held:  # never asked for: nothing can be written, but the context side may hold its KV
            self._bouncer.close_recv(self.sessions.pop(disagg_id))
            self._cancel_everywhere(recv)
            return True
        if len(recv.done) == len(recv.writers):
            self._bouncer.close_recv(self.sessions.pop(disagg_id))
            return True
        if not recv.cancel_sent:
            recv.cancel_sent = True
            self._cancel_everywhere(recv)
        if recv.settled:
            self._bouncer.close_recv(self.sessions.pop(disagg_id))
            return True
        return False

    def forget_instance(self, endpoint: str) -> None:
        """Drop a cached context instance; the next contact runs the canary again."""
        self._control.forget_instance(endpoint)
        gate = self.gates.get(endpoint)
        if gate is not None and gate.passed:
            del self.gates[endpoint]

    # -- control messages and notifications (ControlPlane.drain) ------------------------------
    def on_error(self, message: TransferError) -> None:
        session = self.sessions.get(message.disagg_id)
        if session is not None:
            session.errors[message.sender] = message.reason

    def on_unknown(self, message: UnknownRequest) -> None:
        """That ctx rank will not write (every rank of an instance holds the same requests, so the others
        say the same): the session fails once its writers settled, reported as unknown."""
        session = self.sessions.get(message.disagg_id)
        if session is None:
            return
        session.unknown = True
        session.errors.setdefault(message.sender, message.reason)

    def on_written(self, done: TransferDone) -> None:
        own = self._local.own
        session = self.sessions.get(done.disagg_id)
        if session is None:  # normal after a cancel or timeout: its writes were already in flight
            logger.info("%s: dropped the notification of a write for request %d from %s, which has no "
                        "receive session here (cancelled, timed out or done)", own.key, done.disagg_id, done.sender)
            return
        if done.sender not in session.writers:
            logger.warning("%s: dropped a notification for request %d from %s, which is not one of its "
                           "writers", own.key, done.disagg_id, done.sender)
            return
        if done.bounced and not self._bouncer.scatter(session, done):
            return
        if session.checksum or done.digests:
            problem = self._verify(session, done)
            if problem is not None:
                logger.error("%s: request %d from %s: %s", own.key, done.disagg_id, done.sender, problem)
                session.corrupted.setdefault(done.sender, problem)
        session.on_chunk(done.sender, done.chunk, done.last, done.token_range, done.state)
        session.deadline = self._local.deadline()  # chunks still arriving: not stalled

    # -- internals ----------------------------------------------------------------------------
    def _mark_lost_writers(self) -> None:
        """A writer we still wait on whose control endpoint has had no connection for peer_lost_ms: its
        process is gone (a killed process's port refuses every reconnect) or cut off, so it will not
        write. The sessions waiting on it fail now; they would otherwise wait kv_transfer_timeout_ms."""
        grace = self._local.config.peer_lost_ms / 1000.0
        lost_for: dict[str, float] = {}  # per endpoint, asked once a step however many sessions wait on it
        for session in self.sessions.values():
            if session.held or session.refused is not None:
                continue  # nothing asked of the writers yet (the canary's own session is checked)
            for key, endpoint in session.writers.items():
                if key in session.done or key in session.errors:
                    continue
                if endpoint not in lost_for:
                    lost_for[endpoint] = self._control.unreachable_for(endpoint)
                lost = lost_for[endpoint]
                if lost > grace:
                    session.errors[key] = (f"lost: its control endpoint {endpoint} has had no connection for "
                                           f"{lost:.1f} s (killed, or unreachable)")

    def _cancel_everywhere(self, session: RecvSession) -> None:
        for endpoint in session.all_ctx.values():
            self._control.send(endpoint, Cancel(session.disagg_id, self._local.own.key))

    def _verify(self, session: RecvSession, done: TransferDone) -> str | None:
        """Digest what `done`'s write left in our blocks; None when it matches what the sender sent."""
        own = self._local.own
        if self._local.kv_on_device():
            return (f"write {done.chunk} came with KV checksums, which need host memory; this rank's KV is in "
                    "device memory (turn cache_transceiver_config.checksum off on the context instance)")
        with self._local.timed("checksum"):
            try:
                if not done.src_block_ids:
                    return f"write {done.chunk} came without KV checksums, which this rank asked for"
                plan = plan_write(session.writer_infos[done.sender], own, done.src_block_ids, session.block_ids)
                if plan is None:
                    return f"write {done.chunk} came from a rank that writes nothing here"
                keys, ours = block_digests(plan.dst_ptrs, plan.dst_ptrs, plan.sizes, own.page_table.pools)
                problem = first_mismatch(keys, ours, done.digests)
                return None if problem is None else f"write {done.chunk}: {problem}"
            except (KVTransferError, ValueError) as exc:
                return f"write {done.chunk}: cannot check its KV checksums: {exc}"

    # -- the first-contact canary -------------------------------------------------------------
    def _gate(self, endpoint: str, ctx_ranks: tuple[RankInfo, ...]) -> canary.Gate | None:
        """The canary a request to `endpoint` must wait for, or None once the pair passed (or is not checked)."""
        own = self._local.own
        gate = self.gates.get(endpoint)
        if gate is None:
            tokens = canary.canary_tokens(ctx_ranks[0], own)
            gate = self.gates[endpoint] = canary.Gate(
                endpoint, canary.canary_disagg_id(own.instance_name, endpoint), tokens, ctx_ranks,
                passed=tokens == 0)
            if not tokens:
                logger.info("%s: KV from %s is not checked by a first-contact canary (a side reserved no canary "
                            "blocks: device memory or the canary off; or context parallelism)", own.key, endpoint)
        return None if gate.passed else gate

    def _start_canary(self) -> None:
        """Start the next waiting canary, unless one is running (they share our canary blocks)."""
        gates = self.gates.values()
        if any(g.started and not g.passed for g in gates):
            return
        gate = next((g for g in gates if not g.started and not g.passed), None)
        if gate is None:
            return
        own, gate.started = self._local.own, True
        ids = canary.canary_block_ids(own, gate.num_tokens)
        canary.zero(own, ids, gate.num_tokens)  # what an earlier canary left must not pass for this one
        by_rank = {r.rank: r for r in gate.ctx_ranks}
        self.sessions[gate.disagg_id] = RecvSession(
            gate.disagg_id, writers={by_rank[w].key: by_rank[w].control_endpoint
                                      for w in writers_for(own, gate.ctx_ranks)},
            all_ctx={r.key: r.control_endpoint for r in gate.ctx_ranks}, deadline=self._local.deadline(),
            block_ids=ids)
        requesters = len(self._local.dp_group())
        for ctx in gate.ctx_ranks:
            self._control.send(ctx.control_endpoint, RequestData(
                gate.disagg_id, own.key, ids, (0, gate.num_tokens), requesters, canary=True))

    def _settle_canaries(self) -> None:
        for gate in [g for g in self.gates.values() if g.started and not g.passed]:
            session = self.sessions[gate.disagg_id]
            status = session.local_status()
            if status == TransferStatus.IN_PROGRESS:
                continue
            self._bouncer.close_recv(self.sessions.pop(gate.disagg_id))
            if status == TransferStatus.DONE:
                problem = canary.check(self._local.own, session.block_ids, gate.num_tokens)
            else:
                problem = session.error_text()
                self._cancel_everywhere(session)
            self._open_gate(gate, problem)
        self._start_canary()

    def _open_gate(self, gate: canary.Gate, problem: str | None) -> None:
        """Send the held requests once the canary passed; refuse them (and forget the peer) if it failed."""
        own = self._local.own
        held = [s for s in map(self.sessions.get, gate.held) if s is not None and s.held]
        gate.held = []
        if problem is None:
            gate.passed = True
            logger.info("%s: first-contact canary with %s passed (%d tokens)", own.key, gate.endpoint,
                        gate.num_tokens)
            for session in held:
                messages, session.held = session.held, []
                try:
                    for endpoint, message in messages:
                        self._control.send(endpoint, message)
                except KVTransferError as exc:
                    session.refused = str(exc)
            return
        reason = (f"the first-contact canary with the context instance at {gate.endpoint} failed: {problem}. The "
                  "two instances disagree on where KV bytes go, or the transport moved them wrongly; no KV is taken "
                  "from it until a new first contact passes")
        logger.error("%s: %s", own.key, reason)
        for session in held:
            session.held, session.refused = [], reason
        del self.gates[gate.endpoint]
        self.forget_instance(gate.endpoint)
