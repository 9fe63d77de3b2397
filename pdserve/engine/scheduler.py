"""Continuous batching with chunked prefill, prefix reuse and preemption.

Each step gives every running sequence its next chunk (one token when decoding, a slice of the prompt
when prefilling), then admits waiting sequences while the token budget and KV blocks last. When blocks
run out, the newest running sequence is preempted: its blocks are freed and it is requeued at the
front, to be recomputed later. A pipelined context_only prefill is pinned instead: it reserves its
whole prompt at admission and is never a victim, since its blocks may be mid-transfer. The scheduler never blocks; it only decides.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.engine.block_manager import BlockManager, block_hashes
from pdserve.engine.sequence import RequestType, Sequence, SeqState


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step produces the sequence's next token (its last pending token is computed)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


def _pinned(seq: Sequence) -> bool:
    """A pipelined context_only prefill: its finished blocks are offered to a peer as it goes."""
    return seq.disagg is not None and seq.disagg.pipelined and seq.request_type is RequestType.CONTEXT_ONLY


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_tokens: int, chunked_prefill: bool):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Sequences that hold blocks but take no forward steps: KV leaving (context_only) or arriving
        # (generation_only). Keyed by request id.
        self.parked: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_tokens
        out: list[ScheduledSeq] = []
        preempted = False
        for seq in list(self.running):
            if seq not in self.running:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                continue
            grown = True
            while not self._grow(seq, seq.num_computed_tokens + n):
                victim = next((v for v in reversed(self.running) if not _pinned(v)), None)
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
        if not preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: list[ScheduledSeq], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.request_type is RequestType.GENERATION_ONLY and seq.state is SeqState.WAITING:
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
            if n < seq.num_tokens - num_cached and not self.chunked_prefill:
                break
            # A pipelined prefill holds its whole prompt's blocks from the start: it is never preempted
            # (its blocks may be mid-transfer) and so must never need to grow.
            reserve = seq.num_tokens if _pinned(seq) else num_cached + n
            new_blocks = self.blocks.blocks_needed(reserve) - len(cached)
            # Reviving evictable cached blocks also consumes free slots.
            revived = sum(1 for b in cached if self.blocks.ref_counts[b] == 0)
            if new_blocks + revived > self.blocks.num_free_blocks:
                break
            self.blocks.take(cached)
            seq.block_ids = cached + self.blocks.allocate(new_blocks)
            seq.num_computed_tokens = seq.num_cached_tokens = num_cached
            seq.state = SeqState.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n

    def _park_for_kv(self, seq: Sequence) -> bool:
        """generation_only: allocate blocks for the prompt's KV, which arrives from outside."""
        need = self.blocks.blocks_needed(seq.num_prompt_tokens)
        if need > self.blocks.num_free_blocks:
            return False
        seq.block_ids = self.blocks.allocate(need)
        seq.state = SeqState.GEN_AWAITING_KV
        self.waiting.popleft()
        self.parked[seq.request_id] = seq
        return True

    def kv_arrived(self, request_id: str) -> Sequence:
        """The prompt's KV is in place: decode resumes from the first generated token."""
        seq = self.parked.pop(request_id)
        assert seq.state is SeqState.GEN_AWAITING_KV, f"{request_id} is {seq.state.name}, not awaiting KV"
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.state = SeqState.RUNNING
        self.running.append(seq)
        return seq

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
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.state = SeqState.WAITING
        self.waiting.appendleft(seq)

    def commit(self, batch: list[ScheduledSeq]) -> None:
        """After the forward pass: advance computed counts and publish newly full blocks."""
        tpb = self.blocks.tokens_per_block
        for s in batch:
            seq = s.seq
            before = seq.num_computed_tokens // tpb
            seq.num_computed_tokens += s.num_new_tokens
            full = seq.num_computed_tokens // tpb
            if full > before:
                hashes = block_hashes(seq.all_token_ids[: full * tpb], tpb)
                self.blocks.commit_full_blocks(seq.block_ids, hashes, before)

    def release(self, seq: Sequence) -> None:
        """Drop a finished, aborted or transferred sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.parked.pop(seq.request_id, None)
        if seq.block_ids:
            self.blocks.free(seq.block_ids)
            seq.block_ids = []

    def hold(self, seq: Sequence) -> None:
        """Stop stepping a sequence but keep its blocks (a transfer may still read or write them)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.parked[seq.request_id] = seq

    def park(self, seq: Sequence) -> None:
        """context_only: the first token is out; keep the KV until the transfer settles."""
        self.running.remove(seq)
        seq.state = SeqState.CTX_TRANSMITTING
        self.parked[seq.request_id] = seq
