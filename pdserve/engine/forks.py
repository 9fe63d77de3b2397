"""A request's n > 1 choices: the first step draws a token per choice, then choices 1..n-1 are forked.

    aggregated         prompt ──first step: n draws──> choice 0 goes on, _fork(1..n-1) share its KV
    context_only       prompt ──first step: n draws──> all n ride in the hand-off (ContextResult); no fork
    generation_only    KV arrives with n first tokens ──> choice 0 goes on, _fork(1..n-1) share its KV

`ChoiceForks` is the Scheduler's part that does this (the scheduler keeps the tables it uses: blocks,
running, waiting, seqs, trackers, max_num_seqs, block_copies, state_copies, and _take_token, fail).
A draw is (token, logprob or None, top logprobs or None, error or None).
"""

from __future__ import annotations

from pdserve.engine.sequence import RequestType, Sequence, SeqState, choice_id

Draw = tuple[int, "float | None", "list | None", "str | None"]


class ChoiceForks:
    def _other_draws(self, seq: Sequence, draws: list[Draw]) -> str | None:
        """Choices 1..n-1's first draws, taken before choice 0's own (which may finish it and free its
        blocks). A context_only request keeps them for its answer and decodes nothing more; it returns the
        first draw's error, which fails the request. Otherwise they are forked."""
        if seq.request_type is not RequestType.CONTEXT_ONLY:
            self._fork(seq, draws)
            return None
        seq.forked = True
        error = next((d[3] for d in draws if d[3] is not None), None)
        seq.disagg.first_gen_tokens = tuple(d[0] for d in draws)
        if seq.params.logprobs is not None:
            seq.disagg.first_gen_logprobs = tuple({"token_id": t, "logprob": lp, "top": top or []}
                                                  for t, lp, top, _ in draws)
        return error

    def _first_choices(self, seq: Sequence) -> None:
        """generation_only with n > 1, its prompt's KV in place: choices 1..n-1 fork from it, each from its own
        first token of the hand-off, then choice 0 takes its own (as the aggregated first step does)."""
        d, asked = seq.disagg, seq.params.logprobs is not None
        lps = d.first_gen_logprobs if asked and d.first_gen_logprobs else None
        draws = [(t, lps[c]["logprob"] if lps else None, lps[c]["top"] if lps else None, None)
                 for c, t in enumerate(d.first_gen_tokens)]
        self._fork(seq, draws[1:])
        self._take_token(seq, *draws[0][:3])

    def _fork(self, seq: Sequence, draws: list[Draw]) -> None:
        """Choices 1..n-1 of `seq`'s request, from their first draws. Each shares the prompt's full blocks,
        gets a copy of the partial last one and of the recurrent state (made by every rank before the next
        step), and decodes on from its own first token. A choice that finds no free block, state slot or
        batch row waits, to be computed from its prompt like a preempted request."""
        seq.forked = True
        tpb, done = self.blocks.tokens_per_block, seq.num_computed_tokens
        full, tail = divmod(done, tpb)
        tracker = self.trackers[seq.request_id]
        before = seq.output_token_ids[:done - seq.num_prompt_tokens]  # its output before this first draw
        for c, (token, logprob, top, error) in enumerate(draws, start=1):
            # a forked choice is computed here from the start should it wait (never a KV transfer's)
            child = Sequence(choice_id(seq.request_id, c), seq.prompt_token_ids, seq.params,
                             RequestType.CONTEXT_AND_GENERATION, output_token_ids=list(before),
                             num_cached_tokens=seq.num_cached_tokens, arrival_time=seq.arrival_time, choice=c,
                             group_id=seq.request_id, forked=True)
            self.seqs[child.request_id] = child
            self.trackers[child.request_id] = tracker.fork(child)
            placed = (len(self.running) < self.max_num_seqs and self.blocks.has_state_slot
                      and (not tail or self.blocks.num_free_blocks > 0))
            if placed:
                self.blocks.take(seq.block_ids[:full])
                child.block_ids = seq.block_ids[:full] + (self.blocks.allocate(1) if tail else [])
                child.state_slot = self.blocks.allocate_state()
                child.num_computed_tokens, child.state = done, SeqState.RUNNING
                self.running.append(child)
            else:
                self.waiting.appendleft(child)
            if error is None:
                self._take_token(child, token, logprob, top)
            else:
                self.fail(child, error)
            if placed and child.request_id in self.seqs:  # not ended by its first token
                if tail:
                    self.block_copies.append((seq.block_ids[full], child.block_ids[full]))
                if child.state_slot >= 0:
                    self.state_copies.append((seq.state_slot, child.state_slot))

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The block and state copies the next step must make first."""
        out = self.block_copies, self.state_copies
        self.block_copies, self.state_copies = [], []
        return out
