"""Rank 0's side of the KV exchange: what each rank's KVConnector is told to move, and what happens
to a request when every rank has reported on its transfer.

    step():  commands()  ->  runner.step(spec + commands)  ->  offer(batch)  ->  settle(reports)

- commands(): cancels, sends decided last step, and a "recv" for each generation_only request whose
  context instance's RankInfos are known (fetched off the step loop, PeerDirectory).
- offer(): after a step, the context_only sends it made possible: the whole prompt once prefilled,
  or each chunk's finished blocks when pipelined (kv_transfer/chunking.py).
- settle(): a transfer counts only once every rank reported (TransferTally); then the request moves
  on: KV arrived -> decode resumes; failed -> the request ends with the reason; blocks freed.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import msgpack

from pdserve.engine.kv_connector import PeerDirectory, RankReport, TransferTally
from pdserve.engine.output import RequestOutput
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import FinishReason, RequestType, Sequence, SeqState
from pdserve.kv_transfer.chunking import chunk_blocks

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

# An instance with nothing to step still reads its KV control plane this often: REQUEST_DATA that
# came before (or instead of) its prefill must expire, and CANCELs must be read.
IDLE_POLL_S = 0.2


class KVExchange:
    def __init__(self, engine: "LLMEngine"):
        self.engine = engine
        connector = engine.runner.connector
        self._peers = PeerDirectory(connector.tx.fetch_instance) if connector is not None else None
        self._tally = TransferTally(engine.ecfg.world_size)
        self._cancels: list[int] = []
        self._sends: list[list] = []  # context side: sends decided while post-processing a step
        self._forget: set[str] = set()  # context endpoints every rank must re-learn
        self._failed_outputs: list[RequestOutput] = []  # requests that failed outside a step's batch
        self._last_poll = time.monotonic()

    def poll_due(self) -> bool:
        """Whether an otherwise idle instance should step its ranks' KV connectors now."""
        connector = self.engine.runner.connector
        if connector is None:
            return False
        return connector.tx.control_pending or time.monotonic() - self._last_poll > IDLE_POLL_S

    def polled(self) -> None:
        self._last_poll = time.monotonic()

    def take_failed_outputs(self) -> list[RequestOutput]:
        out, self._failed_outputs = self._failed_outputs, []
        return out

    def close(self) -> None:
        if self._peers is not None:
            self._peers.close()

    def commands(self) -> list[list]:
        """This step's commands for every rank (kv_connector.py), decided on rank 0 without waiting."""
        cmds = [["forget", 0, endpoint] for endpoint in self._forget]
        cmds += self._sends
        cmds += [["cancel", rid] for rid in self._cancels]
        self._forget.clear()
        self._sends = []
        self._cancels.clear()
        peers: dict[str, list[bytes] | Exception | None] = {}
        timeout_ms = self.engine.ecfg.cache_transceiver_config.kv_transfer_timeout_ms
        now = time.monotonic()
        for seq in list(self.engine.scheduler.parked.values()):
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
                cmds.append(["recv", d.disagg_request_id, d.ctx_info_endpoint, seq.block_ids, d.ctx_dp_rank, infos,
                             left_ms])
            elif now > d.kv_deadline:
                self._fail_unstarted(seq, f"timed out at first contact: the context instance at {d.ctx_info_endpoint} "
                                          f"sent no RankInfo within kv_transfer_timeout_ms={timeout_ms}")
        return cmds

    def _fail_unstarted(self, seq: Sequence, reason: str) -> None:
        """A generation_only request whose transfer never began: nothing can write its blocks."""
        seq.error = f"KV transfer failed: {reason}"
        seq.finish(FinishReason.ERROR)
        self._failed_outputs.append(self.engine.trackers.pop(seq.request_id).flush())
        self.engine.retire(seq)

    @staticmethod
    def stage(seq: Sequence) -> str:
        """Where a request's transfer stands, in words, for a log line about it."""
        d = seq.disagg
        if seq.request_type is RequestType.GENERATION_ONLY:
            if seq.state is SeqState.GEN_AWAITING_KV:
                return f"waiting for its KV from {d.ctx_info_endpoint}"
            return "decoding (its KV had arrived)"
        if seq.state is SeqState.RUNNING:
            return "prefilling, its KV leaving chunk by chunk"
        return "prefilled, its KV waiting for the generation instance to pull it"

    def cancel(self, seq: Sequence) -> None:
        """Stop a transfer; the blocks are freed once every rank confirms no write can land."""
        if not seq.disagg.cancelling:
            seq.disagg.cancelling = True
            self._cancels.append(seq.disagg.disagg_request_id)

    def offer(self, batch: list[ScheduledSeq], starts: list[int], sampled: list[bool]) -> None:
        """Context side: queue the sends this step's prefill made possible. A request offers its whole
        prompt once prefilled; a pipelined one offers the full blocks each chunk finished instead
        (kv_transfer/chunking.py). generation_first: the first token rides with the last piece."""
        for s, start, prefill_done in zip(batch, starts, sampled):
            seq, d = s.seq, s.seq.disagg
            if seq.request_type is not RequestType.CONTEXT_ONLY or seq.state is SeqState.FINISHED:
                continue
            n = seq.num_prompt_tokens
            if d.pipelined:
                tpb = self.engine.ecfg.tokens_per_block
                chunk = chunk_blocks({0: seq.block_ids}, {0: None}, tokens_per_block=tpb, chunk_start=start,
                                     chunk_end=start + s.num_new_tokens, prompt_len=n,
                                     reused_len=seq.num_cached_tokens)
                if not chunk.should_send:
                    continue
                ids, span, last = chunk.block_ids[0].tolist(), (chunk.token_start, chunk.token_end), chunk.is_last
            elif prefill_done:
                ids, span, last = list(seq.block_ids), (0, n), True
            else:
                continue
            state = b""
            if last and d.generation_first:
                state = msgpack.packb({"token": seq.output_token_ids[0], "logprobs": seq.output_logprobs[:1]})
            d.transfer_started = True
            self._sends.append(["send", d.disagg_request_id, ids, span[0], span[1], last, state])

    def settle(self, reports: list[RankReport]) -> list[RequestOutput]:
        """Apply every rank's report; requests whose transfer all ranks settled change state."""
        for rank, report in enumerate(reports):
            self._tally.add(rank, report)
            for rid in report.failed:  # stop the other ranks early instead of waiting for their timeout
                seq = self.engine.by_disagg_id.get(rid)
                if seq is not None:
                    self.cancel(seq)
        outputs = []
        for rid, failure in self._tally.settled().items():
            seq = self.engine.by_disagg_id.get(rid)
            delivered, state = self._tally.tokens.pop(rid, None), self._tally.states.pop(rid, None)
            if seq is None:
                continue
            seq.disagg.transfer_settled = True
            if seq.state is SeqState.GEN_AWAITING_KV and failure is None:
                failure = self._kv_arrived(seq, delivered, state, outputs)
                if failure is None:
                    continue
            if failure is not None and seq.disagg.cancelled_while is not None:
                log.info("request %d (%s) was cancelled while %s", rid, seq.request_id, seq.disagg.cancelled_while)
            elif failure is not None:
                log.warning("KV transfer of request %d failed while %s: %s", rid, self.stage(seq), failure)
                if seq.disagg.ctx_info_endpoint:  # it may have restarted: ask again next time
                    self._peers.forget(seq.disagg.ctx_info_endpoint)
                    self._forget.add(seq.disagg.ctx_info_endpoint)
            if seq.state is SeqState.GEN_AWAITING_KV:
                seq.error = f"KV transfer from {seq.disagg.ctx_info_endpoint} failed: {failure}"
                seq.finish(FinishReason.ERROR)
            elif seq.state is SeqState.RUNNING:  # a pipelined prefill whose receiver went away
                self.engine.scheduler.hold(seq)
                seq.error = f"KV transfer to the generation instance failed: {failure}"
                seq.finish(FinishReason.ERROR)
            tracker = self.engine.trackers.pop(seq.request_id, None)
            if tracker is not None and seq.finish_reason is not FinishReason.ABORT:
                outputs.append(tracker.flush())
            self.engine.retire(seq)
        return outputs

    def _kv_arrived(self, seq: Sequence, delivered: int | None, state: bytes | None,
                    outputs: list[RequestOutput]) -> str | None:
        """generation_only: the KV is in place; resume decoding. Returns why it cannot, or None."""
        if delivered is not None and delivered != seq.num_prompt_tokens:
            return (f"the context instance sent KV for {delivered} prompt tokens but this request's prompt has "
                    f"{seq.num_prompt_tokens}: both instances must see the same prompt tokens")
        first = None
        if seq.disagg.generation_first:
            try:
                first = msgpack.unpackb(state)
                token, logprobs = int(first["token"]), list(first["logprobs"])
            except (TypeError, ValueError, KeyError, msgpack.UnpackException):
                return "the KV arrived without the first generated token (is the context worker a pdserve worker?)"
        self.engine.scheduler.kv_arrived(seq.request_id)
        if first is not None:
            seq.output_token_ids.append(token)
            if seq.params.logprobs is not None:
                seq.output_logprobs += [{**e, "top": [tuple(t) for t in e["top"]]} for e in logprobs]
            self.engine.check_stop(seq, token)
        if seq.is_finished:
            self.engine.retire(seq)
            outputs.append(self.engine.trackers.pop(seq.request_id).flush())
        else:
            outputs.append(self.engine.trackers[seq.request_id].flush())
        return None
