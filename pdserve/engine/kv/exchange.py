"""Rank 0's side of the KV exchange: what each rank's KVConnector is told to move, and what every
rank's reports mean for a request, which it tells the scheduler (the lifecycle's owner).

    step():  schedule()  ->  runner.step(spec + commands())  ->  postprocess()  ->  settle(batch, reports)

- commands(): forgets, sends decided last step, cancels the scheduler asked for, and a receive for each
  generation_only request whose context instance's RankInfos are known (fetched off the step loop,
  PeerDirectory).
- settle(): first the context_only sends the step made possible (the whole prompt once prefilled, or
  each chunk's finished blocks when pipelined, kv_transfer/chunking.py); then every rank's report. A
  transfer counts only once every rank reported (TransferTally); then the scheduler moves the request
  on: scheduler.kv_arrived (decode resumes) or scheduler.transfer_ended (sent, failed, cancelled).
"""

from __future__ import annotations

import logging
import time

from pdserve.config import EngineConfig
from pdserve.engine.kv.connector import LAYER_GROUP, STATE_GROUP, KVConnector, PeerDirectory, TransferTally
from pdserve.engine.kv.wire import (CancelKV, FirstToken, ForgetPeer, KVCommand, KVWireError, RankReport, ReceiveKV,
                                    SendKV)
from pdserve.engine.scheduler import KV_NOT_FOUND, ScheduledSeq, Scheduler
from pdserve.engine.sequence import RequestType, Sequence, SeqState
from pdserve.kv_transfer.chunking import chunk_blocks

log = logging.getLogger(__name__)

# An instance with nothing to step still reads its KV control plane this often: REQUEST_DATA that
# came before (or instead of) its prefill must expire, and CANCELs must be read.
IDLE_POLL_S = 0.2
# A step that ran no sequence only polled the transfers: wait up to this long after it, so an instance
# with only transfers in flight does not spin. The transceiver ends the wait early when a control message,
# a finished write or a notification (for agents that signal them: shm) comes (KVTransceiver.wait).
IDLE_STEP_SLEEP_S = 0.001


class KVExchange:
    def __init__(self, scheduler: Scheduler, connector: KVConnector | None, ecfg: EngineConfig, vocab_size: int):
        self.scheduler = scheduler
        self._vocab_size = vocab_size  # a first token that came with the KV is checked against it
        self._connector = connector
        self._peers = PeerDirectory(connector.tx.fetch_instance) if connector is not None else None
        self._tally = TransferTally(ecfg.world_size)
        self._timeout_ms = ecfg.cache_transceiver_config.kv_transfer_timeout_ms
        self._tokens_per_block = ecfg.tokens_per_block
        self._sends: list[SendKV] = []  # context side: sends decided while settling a step
        self._forget: set[str] = set()  # context endpoints every rank must re-learn
        self._last_poll = time.monotonic()

    def poll_due(self) -> bool:
        """Whether an otherwise idle instance should step its ranks' KV connectors now."""
        if self._connector is None:
            return False
        return self._connector.tx.control_pending or time.monotonic() - self._last_poll > IDLE_POLL_S

    def close(self) -> None:
        if self._peers is not None:
            self._peers.close()

    def commands(self) -> list[KVCommand]:
        """This step's commands for every rank (wire.py), decided on rank 0 without waiting."""
        cmds: list[KVCommand] = [ForgetPeer(endpoint) for endpoint in self._forget]
        cmds += self._sends
        cmds += [CancelKV(rid) for rid in self.scheduler.cancels]
        self._forget.clear()
        self._sends = []
        self.scheduler.cancels.clear()
        peers: dict[str, list[bytes] | Exception | None] = {}
        timeout_ms = self._timeout_ms
        now = time.monotonic()
        for seq in list(self.scheduler.parked.values()):
            d = seq.disagg
            if d is None or d.transfer_started or seq.state is not SeqState.GEN_AWAITING_KV:
                continue
            # Every wait of the transfer, first contact included, counts from the request's admission.
            d.kv_deadline = d.kv_deadline or now + timeout_ms / 1000
            if d.ctx_info_endpoint not in peers:
                peers[d.ctx_info_endpoint] = self._peers.lookup(d.ctx_info_endpoint)
            infos = peers[d.ctx_info_endpoint]
            if isinstance(infos, Exception):
                self._fail_unstarted(seq, f"context instance at {d.ctx_info_endpoint} did not answer: {infos}")
            elif infos is not None:
                d.transfer_started = True
                left_ms = max(1, int((d.kv_deadline - now) * 1000))
                cmds.append(ReceiveKV(d.disagg_request_id, d.ctx_info_endpoint, tuple(seq.block_ids), d.ctx_dp_rank,
                                      tuple(infos), left_ms, wait_for_offer=d.generation_first,
                                      state_slot=seq.state_slot))
            elif now > d.kv_deadline:
                self._fail_unstarted(seq, f"timed out at first contact: the context instance at {d.ctx_info_endpoint} "
                                          f"sent no RankInfo within kv_transfer_timeout_ms={timeout_ms}")
        return cmds

    def _fail_unstarted(self, seq: Sequence, reason: str) -> None:
        """A generation_only request whose transfer never began: nothing can write its blocks."""
        self.scheduler.fail(seq, f"KV transfer failed: {reason}", quiet=True)

    def settle(self, batch: list[ScheduledSeq], reports: list[RankReport | None]) -> None:
        """After postprocess: queue the sends `batch` made possible, then apply every rank's reports
        (one list per runner step taken)."""
        self._last_poll = time.monotonic()
        if batch:
            self._offer(batch)
        for report in reports:
            if report is not None:
                self._settle(report)
        if not batch:
            if self._connector is not None:
                self._connector.tx.wait(IDLE_STEP_SLEEP_S)
            else:
                time.sleep(IDLE_STEP_SLEEP_S)

    def _offer(self, batch: list[ScheduledSeq]) -> None:
        """Context side: queue the sends this step's prefill made possible. A request offers its whole
        prompt once prefilled; a pipelined one offers the full blocks each chunk finished instead
        (kv_transfer/chunking.py). generation_first: the first token rides with the last piece."""
        for s in batch:
            seq, d = s.seq, s.seq.disagg
            if seq.request_type is not RequestType.CONTEXT_ONLY or seq.state is SeqState.FINISHED:
                continue
            n = seq.num_prompt_tokens
            if d.pipelined:
                # A hybrid model's state slot rides as a recurrent group: the last piece only (chunking.py)
                ids = {LAYER_GROUP: seq.block_ids, STATE_GROUP: [seq.state_slot]}
                chunk = chunk_blocks(ids, dict.fromkeys(ids), tokens_per_block=self._tokens_per_block,
                                     chunk_start=s.start, chunk_end=s.start + s.num_new_tokens, prompt_len=n,
                                     reused_len=seq.num_cached_tokens, recurrent=frozenset({STATE_GROUP}))
                if not chunk.should_send:
                    continue
                blocks, span = tuple(chunk.block_ids[LAYER_GROUP].tolist()), (chunk.token_start, chunk.token_end)
                last, slot = chunk.is_last, int(chunk.block_ids[STATE_GROUP][0])
            elif s.samples:  # the prompt's prefill is done
                blocks, span, last, slot = tuple(seq.block_ids), (0, n), True, seq.state_slot
            else:
                continue
            state = b""
            if last and d.generation_first:
                state = FirstToken(seq.output_token_ids[0], tuple(seq.output_logprobs[:1])).to_bytes()
            d.transfer_started = True
            self._sends.append(SendKV(d.disagg_request_id, blocks, span[0], span[1], last, state, slot))

    def _settle(self, reports: list[RankReport]) -> None:
        """Apply every rank's report; requests whose transfer all ranks settled move on."""
        by_disagg_id = self.scheduler.by_disagg_id
        for rank, report in enumerate(reports):
            self._tally.add(rank, report)
            for rid in report.failed:  # stop the other ranks early instead of waiting for their timeout
                seq = by_disagg_id.get(rid)
                if seq is not None:
                    self.scheduler.cancel_transfer(seq)
        for rid, failure in self._tally.settled().items():
            seq = by_disagg_id.get(rid)
            delivered, state = self._tally.tokens.pop(rid, None), self._tally.states.pop(rid, None)
            unknown = rid in self._tally.unknown
            self._tally.unknown.discard(rid)
            if seq is None:
                continue
            try:
                self._settle_one(seq, failure, delivered, state, unknown)
            except Exception as e:  # one request's bookkeeping must not stop the step loop
                log.exception("request %s: settling its KV transfer failed", seq.request_id)
                self.scheduler.fail(seq, f"KV transfer failed: {type(e).__name__}: {e}", quiet=True)

    def _settle_one(self, seq: Sequence, failure: str | None, delivered: int | None, state: bytes | None,
                    unknown: bool) -> None:
        """Every rank settled `seq`'s transfer: decode resumes, or the request ends (failure: why)."""
        rid = seq.disagg.disagg_request_id
        if seq.state is SeqState.GEN_AWAITING_KV and failure is None:
            failure, first = self._arrival(seq, delivered, state)
            if failure is None:
                self.scheduler.kv_arrived(seq, first)
                return
        if failure is not None and seq.disagg.cancelled_while is not None:
            log.info("request %d (%s) was cancelled while %s", rid, seq.request_id, seq.disagg.cancelled_while)
        elif unknown:  # a live context instance answered: nothing to forget about it
            log.info("KV transfer of request %d failed: %s", rid, failure)
        elif failure is not None:
            log.warning("KV transfer of request %d failed while %s: %s", rid, seq.transfer_stage, failure)
            if seq.disagg.ctx_info_endpoint:  # it may have restarted: ask again next time
                self._peers.forget(seq.disagg.ctx_info_endpoint)
                self._forget.add(seq.disagg.ctx_info_endpoint)
        self.scheduler.transfer_ended(seq, failure, KV_NOT_FOUND if unknown and failure is not None else None)

    def _arrival(self, seq: Sequence, delivered: int | None,
                 state: bytes | None) -> tuple[str | None, FirstToken | None]:
        """generation_only, every rank reported its KV in: (why it cannot be used, or None; the first
        token and its logprobs when they rode with the KV, generation_first)."""
        if delivered is not None and delivered != seq.num_prompt_tokens:
            return (f"the context instance sent KV for {delivered} prompt tokens but this request's prompt has "
                    f"{seq.num_prompt_tokens}: both instances must see the same prompt tokens"), None
        if not seq.disagg.generation_first:
            return None, None
        if not state:
            return "the KV arrived without the first generated token (is the context worker a pdserve worker?)", None
        try:
            first = FirstToken.from_bytes(state)
        except KVWireError as e:
            return f"the first generated token that came with the KV is malformed: {e}", None
        ids = [first.token] + [t for e in first.logprobs for t in [e["token_id"]] + [t for t, _ in e["top"]]]
        if any(not 0 <= t < self._vocab_size for t in ids):
            return (f"the first generated token that came with the KV is not in the vocabulary "
                    f"[0, {self._vocab_size})"), None
        return None, first
