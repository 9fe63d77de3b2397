"""Continuous batching, and the one owner of a request's lifecycle.

`schedule()` decides a step; `postprocess(batch, result)` applies its tokens (nano-vllm's
`scheduler.postprocess(batch, out)`). Every state change of a request happens in this module: the
engine only asks (add, abort, release_kv), and the KV exchange only reports what every rank settled
(kv_arrived, transfer_ended) or that a transfer never began (fail).

Lifecycle. SeqState is an ordered IntEnum; each arrow names the call that takes it:

  add() ──> WAITING ──schedule(): _admit (prefix matched, blocks allocated)──> RUNNING ──postprocess()──> FINISHED
              │  ^                                                             │  │  ^   EOS, a stop id or string,
              │  └──────schedule(): _preempt (blocks freed, recomputed later)──┘  │  │   max_tokens, context window
              │                                                                   │  │
              │ schedule(): _park_for_kv                                          │  │ kv_arrived(): decode resumes
              v (generation_only: blocks for the prompt's KV)                     │  │ from first_gen_tokens, or
        GEN_AWAITING_KV ──────────────────────────────────────────────────────────┼──┘ from the token that came
              │                                                                   │    with the KV (generation_first)
              │                                                                   │ postprocess(): a context_only's
              │                                                                   v first token is out, KV kept
              │                                                            CTX_TRANSMITTING
              │                                                                   │ transfer_ended(): sent,
              │                                                                   v failed or cancelled
              └──transfer_ended(): failed; fail(): first contact failed────> FINISHED

  Any state ──end() (abort, release_kv, fail)──> FINISHED. Its blocks are freed at once (_retire), or,
  while a transfer may still write them, the request is held (_hold: parked, not stepped) and its
  transfer cancelled, until transfer_ended() reports that every rank confirmed the cancel.
  A context_only generation_first request whose first token already ends it still parks in
  CTX_TRANSMITTING: the generation side waits for that KV all the same.
  (One more arrow lives in output.py: OutputTracker.on_token finishes a request on a stop string.)

A request with n > 1 choices (forks.py): its first sampling step draws a token per choice; aggregated,
choices 1..n-1 are forked into RUNNING (or WAITING, when no room); context_only, every draw rides in its
answer and it parks in CTX_TRANSMITTING even if choice 0's token ended it; generation_only, kv_arrived()
forks them from the KV that arrived, each from its own first token.

Where a request is: `waiting` (no blocks), `running` (blocks, stepped), `parked` (blocks, not stepped:
GEN_AWAITING_KV, CTX_TRANSMITTING, or held), or retired (gone from every table, blocks freed).

When blocks run out, the newest running sequence is preempted: its blocks are freed and it is
requeued at the front, to be recomputed later. A pipelined context_only prefill is pinned instead: it
reserves its whole prompt at admission and is never a victim, since its blocks may be mid-transfer.
The scheduler never blocks; it only decides and records.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.block_manager import BlockManager, block_hashes
from pdserve.engine.forks import ChoiceForks
from pdserve.engine.kv.wire import FirstToken
from pdserve.engine.output import ContextResult, OutputTracker, RequestOutput
from pdserve.engine.sequence import FinishReason, RequestType, Sequence, SeqState
from pdserve.engine.step_budget import TpotBudget, sliver_waits

if TYPE_CHECKING:
    from pdserve.engine.sampler import SampleResult

log = logging.getLogger(__name__)

# Sequence.error_code of a generation_only request whose context instance holds no such request (never
# had it, or its KV was already sent, released or timed out): the client's error, not the service's.
KV_NOT_FOUND = "kv_not_found"
# Sequence.error_code of a guided request whose grammar failed on its way (llguidance's parser refused a row
# too wide for it, at some output token): the request's grammar is to blame, so the client's error.
GRAMMAR_FAILED = "grammar_failed"


@dataclass
class ScheduledSeq:
    """One sequence's part of a step, fixed when it is scheduled (commit() advances the sequence)."""

    seq: Sequence
    num_new_tokens: int
    start: int = field(init=False)  # the first position this step computes
    samples: bool = field(init=False)  # this step produces the next token (its last pending one is computed)
    choices: int = field(init=False)  # tokens it samples: n when it forks a request's choices, else 1

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == self.seq.num_tokens
        self.choices = self.seq.params.n if self.samples and self.seq.forks_now else 1

    @property
    def prefills(self) -> bool:
        """Computes prompt tokens (a chunk, or a whole prompt), not one decode token."""
        return self.num_new_tokens > 1 or self.seq.num_tokens - self.start > 1


class Scheduler(ChoiceForks):
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_tokens: int, chunked_prefill: bool,
                 eos_token_ids: frozenset[int] = frozenset(), max_model_len: int = sys.maxsize,
                 tpot_budget: TpotBudget | None = None):
        self.blocks = blocks
        self.tpot_budget = tpot_budget  # None: every step may fill max_num_tokens with prefill
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.chunked_prefill = chunked_prefill
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Sequences that hold blocks but take no forward steps: KV leaving (context_only) or arriving
        # (generation_only), or held until a cancelled transfer settles. Keyed by request id.
        self.parked: dict[str, Sequence] = {}
        self.seqs: dict[str, Sequence] = {}  # every request not yet retired
        self.trackers: dict[str, OutputTracker] = {}  # requests whose client answer is not complete yet
        self.by_disagg_id: dict[int, Sequence] = {}
        self.outputs: list[RequestOutput] = []  # the output sink: what clients are told, drained each step
        self.cancels: list[int] = []  # disagg ids whose transfer every rank must stop (the KV exchange sends them)
        # Forked choices' copies of their request's partial last block and recurrent state, (source, copy):
        # every rank makes them before the next forward step (engine: the step spec carries them).
        self.block_copies: list[tuple[int, int]] = []
        self.state_copies: list[tuple[int, int]] = []

    def add(self, seq: Sequence, tracker: OutputTracker | None = None) -> None:
        """A new request: WAITING. `tracker` defaults to one without a detokenizer (no text)."""
        if seq.disagg is not None:
            self.by_disagg_id[seq.disagg.disagg_request_id] = seq
        self.seqs[seq.request_id] = seq
        self.trackers[seq.request_id] = tracker or OutputTracker(seq, None)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_outputs(self) -> list[RequestOutput]:
        out, self.outputs = self.outputs, []
        return out

    # -- schedule(): WAITING -> RUNNING | GEN_AWAITING_KV, RUNNING -> WAITING --------------------------

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_tokens
        prefill = self._prefill_allowance()
        out: list[ScheduledSeq] = []
        preempted = False
        for seq in list(self.running):
            if seq not in self.running:  # preempted earlier in this loop
                continue
            left = seq.num_tokens - seq.num_computed_tokens
            n = min(left, budget) if left <= 1 else min(left, budget, prefill)
            if n <= 0:
                continue
            grown = True
            while not self._grow(seq, seq.num_computed_tokens + n):
                victim = next((v for v in reversed(self.running) if not v.pinned), None)
                if victim is None:  # only pinned sequences left: this one waits for blocks
                    grown = False
                    break
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq in self.running and grown:
                out.append(ScheduledSeq(seq, n))
                budget -= n
                if left > 1:
                    prefill -= n
        if not preempted:
            self._admit(out, min(budget, prefill))
        return out

    def _prefill_allowance(self) -> int:
        """Prefill tokens this step may take beside the requests it decodes (step_budget.py)."""
        if self.tpot_budget is None:
            return self.max_num_tokens
        decoding = [(len(seq.output_token_ids), max(seq.params.max_tokens - len(seq.output_token_ids) - 1, 0),
                     seq.first_token_time, seq.num_tokens) for seq in self.running
                    if seq.num_tokens - seq.num_computed_tokens == 1 and seq.first_token_time is not None]
        offset = next((seq.num_computed_tokens for seq in self.running
                       if seq.num_tokens - seq.num_computed_tokens > 1), 0)
        return self.tpot_budget.prefill_tokens(decoding, offset, time.monotonic())

    def _admit(self, out: list[ScheduledSeq], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Its KV is asked for once; preempted after it arrived, it is recomputed like any request.
            if (seq.request_type is RequestType.GENERATION_ONLY and seq.state is SeqState.WAITING
                    and not seq.disagg.transfer_started):
                if not self._park_for_kv(seq):
                    break
                continue
            tokens = seq.all_token_ids
            tpb = self.blocks.tokens_per_block
            # Keep at least one token to compute: its logits produce the next token.
            hashes = block_hashes(tokens[: len(tokens) - 1], tpb)
            cached = self.blocks.match_prefix(hashes)
            num_cached = len(cached) * tpb
            n = min(seq.num_tokens - num_cached, budget)
            if n < seq.num_tokens - num_cached and (not self.chunked_prefill or sliver_waits(
                    seq.num_tokens - num_cached - n, self.max_num_tokens, any(b.prefills for b in out))):
                break
            # A pipelined prefill holds its whole prompt's blocks from the start: it is never preempted
            # (its blocks may be mid-transfer) and so must never need to grow.
            reserve = seq.num_tokens if seq.pinned else num_cached + n
            new_blocks = self.blocks.blocks_needed(reserve) - len(cached)
            # Reviving evictable cached blocks also consumes free slots.
            revived = sum(1 for b in cached if self.blocks.ref_counts[b] == 0)
            if new_blocks + revived > self.blocks.num_free_blocks or not self.blocks.has_state_slot:
                break
            self.blocks.take(cached)
            seq.block_ids = cached + self.blocks.allocate(new_blocks)
            seq.state_slot = self.blocks.allocate_state()
            seq.num_computed_tokens = seq.num_cached_tokens = num_cached
            seq.state = SeqState.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n

    def _park_for_kv(self, seq: Sequence) -> bool:
        """generation_only: allocate blocks for the prompt's KV, which arrives from outside."""
        need = self.blocks.blocks_needed(seq.num_prompt_tokens)
        if need > self.blocks.num_free_blocks or not self.blocks.has_state_slot:
            return False
        seq.block_ids = self.blocks.allocate(need)
        seq.state_slot = self.blocks.allocate_state()  # a hybrid model's state lands there with the KV
        seq.state = SeqState.GEN_AWAITING_KV
        self.waiting.popleft()
        self.parked[seq.request_id] = seq
        return True

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        extra = self.blocks.blocks_needed(num_tokens) - len(seq.block_ids)
        if extra <= 0:
            return True
        if extra > self.blocks.num_free_blocks:
            return False
        seq.block_ids += self.blocks.allocate(extra)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_ids)
        self.blocks.free_state(seq.state_slot)  # recomputed from the first token, as its KV is
        seq.block_ids, seq.state_slot = [], -1
        seq.num_computed_tokens = 0
        seq.state = SeqState.WAITING
        self.waiting.appendleft(seq)

    # -- postprocess(): RUNNING -> RUNNING | CTX_TRANSMITTING | FINISHED -------------------------------

    def postprocess(self, batch: list[ScheduledSeq], result: SampleResult | None) -> None:
        """After the forward pass: advance computed counts, publish newly full blocks, take each sampled
        token and apply what it means for its request. `result` holds one row per sampling sequence."""
        sampling = [s for s in batch if s.samples]
        self.commit(batch)
        row = 0
        for s in sampling:
            i, row = row, row + s.choices
            others = [(result.token_ids[j], result.logprobs[j], result.top_logprobs[j], result.error(j))
                      for j in range(i + 1, row)]
            error = (self._other_draws(s.seq, others) if others else None) or result.error(i)
            try:
                if error is None:
                    self._take_token(s.seq, result.token_ids[i], result.logprobs[i], result.top_logprobs[i])
            except Exception as e:  # one request's bookkeeping (detokenizing, say) must not stop the loop
                log.exception("request %s: handling its token failed", s.seq.request_id)
                error = f"{type(e).__name__}: {e}"
            if error is not None:  # a guided row whose grammar failed was masked to nothing: its cause is told
                self.fail(s.seq, s.seq.refusal or error)

    def commit(self, batch: list[ScheduledSeq]) -> None:
        """After the forward pass: advance computed counts and publish newly full blocks."""
        for s in batch:
            before = s.seq.num_computed_tokens
            s.seq.num_computed_tokens += s.num_new_tokens
            self._publish(s.seq, before)

    def _publish(self, seq: Sequence, before: int) -> None:
        """Offer the prefix cache `seq`'s blocks that became full past its first `before` computed tokens."""
        tpb = self.blocks.tokens_per_block
        first, full = before // tpb, seq.num_computed_tokens // tpb
        if full > first:
            self.blocks.commit_full_blocks(seq.block_ids, block_hashes(seq.all_token_ids[: full * tpb], tpb), first)

    def _take_token(self, seq: Sequence, token: int, logprob: float | None, top: list | None) -> None:
        seq.output_token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if logprob is not None:
            seq.output_logprobs.append({"token_id": token, "logprob": logprob, "top": top or []})
        self._check_stop(seq, token)
        # generation_first: the generation side waits for this prompt's KV even when the first
        # token already ends the request, so it is sent all the same.
        # n > 1: its other choices' first tokens ride in its answer, whether or not this one ended.
        awaited = seq.request_type is RequestType.CONTEXT_ONLY and (seq.disagg.generation_first or seq.params.n > 1)
        if seq.is_finished and not awaited:
            self._retire(seq)
            self.outputs.append(self.trackers.pop(seq.request_id).flush())
        elif seq.request_type is RequestType.CONTEXT_ONLY:
            self._park(seq)
            self.outputs.append(self._context_answer(seq))
        else:
            self.outputs.append(self.trackers[seq.request_id].flush())

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        is_eos = token in self.eos_token_ids and not p.ignore_eos
        is_stop_id = token in p.stop_token_set
        self.trackers[seq.request_id].on_token(token, is_eos or is_stop_id,
                                               stop_strings=len(seq.output_token_ids) >= p.min_tokens)
        if seq.is_finished:  # a stop string matched
            return
        if is_eos:
            seq.finish(FinishReason.STOP)
        elif is_stop_id:
            seq.finish(FinishReason.STOP, token)
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish(FinishReason.LENGTH)

    def _park(self, seq: Sequence) -> None:
        """context_only: the first token is out; keep the KV until the transfer settles."""
        self.running.remove(seq)
        seq.state = SeqState.CTX_TRANSMITTING
        self.parked[seq.request_id] = seq

    def _context_answer(self, seq: Sequence) -> RequestOutput:
        """context_only: the client's answer is complete; the KV stays until the transfer settles."""
        out = self.trackers.pop(seq.request_id).flush()
        out.finished, out.finish_reason = True, (seq.finish_reason or FinishReason.LENGTH).value
        d = seq.disagg
        others = tuple(FirstToken(t, d.first_gen_logprobs[c:c + 1]) for c, t in enumerate(d.first_gen_tokens))
        out.context = ContextResult(d.disagg_request_id,
                                    FirstToken(seq.output_token_ids[0], tuple(seq.output_logprobs[:1])), others)
        return out

    # -- what the KV exchange settled: GEN_AWAITING_KV -> RUNNING, CTX_TRANSMITTING -> FINISHED ---------

    def kv_arrived(self, seq: Sequence, first: FirstToken | None = None) -> None:
        """generation_only: the prompt's KV is in place; decode resumes from the first generated token.
        generation_first: `first` came with the KV."""
        seq.disagg.transfer_settled = True
        seq.first_token_time = time.monotonic()  # decoding starts here: the first token came from elsewhere
        del self.parked[seq.request_id]
        assert seq.state is SeqState.GEN_AWAITING_KV, f"{seq.request_id} is {seq.state.name}, not awaiting KV"
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._publish(seq, 0)  # the prompt's KV came whole: a later request with its prefix reuses it here
        seq.state = SeqState.RUNNING
        self.running.append(seq)
        if seq.forks_now:  # n > 1 (context_first): every choice's first token came with the request
            self._first_choices(seq)
            return
        if first is not None:
            seq.output_token_ids.append(first.token)
            if seq.params.logprobs is not None:
                seq.output_logprobs += first.logprobs
            self._check_stop(seq, first.token)
        if seq.is_finished:
            self._retire(seq)
            self.outputs.append(self.trackers.pop(seq.request_id).flush())
        else:
            self.outputs.append(self.trackers[seq.request_id].flush())

    def transfer_ended(self, seq: Sequence, failure: str | None, code: str | None = None) -> None:
        """Every rank settled `seq`'s transfer and its KV did not arrive here (context side: sent,
        failed or cancelled; generation side: failed or cancelled): the request ends, its blocks freed.
        `code`: the failure's kind when the client is told one (KV_NOT_FOUND)."""
        seq.disagg.transfer_settled = True
        if seq.state is SeqState.GEN_AWAITING_KV:
            seq.error_code = code
            self.end(seq, FinishReason.ERROR, f"KV transfer from {seq.disagg.ctx_info_endpoint} failed: {failure}")
        elif seq.state is SeqState.RUNNING:  # a pipelined prefill whose receiver went away
            self.end(seq, FinishReason.ERROR, f"KV transfer to the generation instance failed: {failure}")
        else:  # CTX_TRANSMITTING: its answer went out when it parked; FINISHED: held for this to settle
            seq.state = SeqState.FINISHED
            self._retire(seq)
        tracker = self.trackers.pop(seq.request_id, None)
        if tracker is not None and seq.finish_reason is not FinishReason.ABORT:
            self.outputs.append(tracker.flush())

    def cancel_transfer(self, seq: Sequence) -> None:
        """Ask every rank to stop `seq`'s transfer (the KV exchange sends it with the next step)."""
        if not seq.disagg.cancelling:
            seq.disagg.cancelling = True
            self.cancels.append(seq.disagg.disagg_request_id)

    # -- ending early: any state -> FINISHED ------------------------------------------------------------

    def abort(self, request_id: str) -> None:
        """End a request, every choice of it."""
        for seq in self._choices(request_id):
            if not seq.is_finished:
                self.end(seq, FinishReason.ABORT)

    def _choices(self, request_id: str) -> list[Sequence]:
        """The request's sequences not yet retired: itself, or each of its n > 1 choices still going."""
        seq = self.seqs.get(request_id)
        if seq is not None and seq.params.n == 1:
            return [seq]
        return [s for s in self.seqs.values() if s.client_id == request_id]

    def release_kv(self, disagg_request_id: int) -> bool:
        """An answered context_only request whose KV nobody will pull: free it now. False when no such
        request is here (already pulled, never here, or its answer is still due)."""
        seq = self.by_disagg_id.get(disagg_request_id)
        if seq is None or seq.request_type is not RequestType.CONTEXT_ONLY or seq.request_id in self.trackers:
            return False
        if seq.disagg.cancelling:
            return True
        self.end(seq, FinishReason.ABORT)
        return True

    def fail(self, seq: Sequence, reason: str, quiet: bool = False) -> None:
        """End `seq` with an error the client sees (HTTP 500 naming `reason`). Blocks are freed now, or
        once every rank confirms that no transfer can still touch them. `quiet`: the caller logged it."""
        if seq.request_id not in self.seqs:  # already retired
            return
        if not quiet:
            log.error("request %s failed: %s", seq.request_id, reason)
        self.end(seq, FinishReason.ERROR, reason)
        tracker = self.trackers.pop(seq.request_id, None)
        if tracker is not None:
            self.outputs.append(tracker.flush())

    def end(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Finish `seq` before its time. Its blocks are freed now, or, while a transfer may still write
        them, once every rank confirms the cancel (transfer_ended)."""
        d = seq.disagg
        cancel = d is not None and d.may_still_write
        if cancel:
            d.cancelled_while = seq.transfer_stage
        if not seq.is_finished or error is not None:
            seq.error = error
            seq.finish(reason)
        if cancel:
            self._hold(seq)
            self.cancel_transfer(seq)
        else:
            self._retire(seq)

    def take_abort_output(self, request_id: str) -> RequestOutput | None:
        """An aborted request's last output (its first choice's; its other choices' are dropped)."""
        ids = [k for k, t in self.trackers.items() if t.seq.client_id == request_id]
        outs = [self.trackers.pop(k).flush() for k in ids]
        return outs[0] if outs else None

    # -- where a request is ------------------------------------------------------------------------

    def _retire(self, seq: Sequence) -> None:
        """Drop a finished, aborted or transferred sequence from every table and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.parked.pop(seq.request_id, None)
        if seq.block_ids:
            self.blocks.free(seq.block_ids)
            seq.block_ids = []
        self.blocks.free_state(seq.state_slot)
        seq.state_slot = -1
        self.seqs.pop(seq.request_id, None)
        if seq.disagg is not None:
            self.by_disagg_id.pop(seq.disagg.disagg_request_id, None)

    def _hold(self, seq: Sequence) -> None:
        """Stop stepping a sequence but keep its blocks (a transfer may still read or write them)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.parked[seq.request_id] = seq
