"""The scheduler on its own, with plain factories (no model, no processes): every lifecycle
transition it makes, and the blocks each one takes or gives back."""

from __future__ import annotations

from pdserve.engine.block_manager import BlockManager, KVEvent, block_hashes
from pdserve.engine.kv.wire import FirstToken
from pdserve.engine.output import ContextResult
from pdserve.engine.sampler import SampleResult
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import DisaggInfo, FinishReason, RequestType, Sequence, SeqState

W, GEN_KV, R, CTX_TX, F = (SeqState.WAITING, SeqState.GEN_AWAITING_KV, SeqState.RUNNING,
                           SeqState.CTX_TRANSMITTING, SeqState.FINISHED)


def _sched(num_blocks: int = 8, tpb: int = 4, max_num_tokens: int = 64, chunked: bool = True, **kw) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, tpb), 8, max_num_tokens, chunked, **kw)


def _seq(rid: str, n: int, max_tokens: int = 8, rtype=RequestType.CONTEXT_AND_GENERATION, disagg=None,
         **params) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, **params), rtype, disagg=disagg)


def _distinct(rid: str, n: int, first: int) -> Sequence:
    """A prompt that shares no prefix with _seq's."""
    return Sequence(rid, list(range(first, first + n)), SamplingParams(max_tokens=8))


def _tokens(*ids: int) -> SampleResult:
    """What the sampler returns: one row per sequence of the batch that samples."""
    return SampleResult(list(ids), [None] * len(ids), [None] * len(ids))


def _all_free(s: Scheduler) -> bool:
    return s.blocks.num_free_blocks == s.blocks.num_blocks and not any(s.blocks.ref_counts)


def _view(batch) -> list[tuple[str, int, int, bool]]:
    return [(b.seq.request_id, b.num_new_tokens, b.start, b.samples) for b in batch]


def test_admit_prefill_decode_and_finish_frees_every_block():
    s = _sched()
    a = _seq("a", 4, max_tokens=3)
    s.add(a)
    assert a.state is W and list(s.waiting) == [a] and s.seqs == {"a": a}
    batch = s.schedule()
    assert _view(batch) == [("a", 4, 0, True)]
    assert a.state is R and a.block_ids == [0] and s.running == [a] and not s.waiting
    s.postprocess(batch, _tokens(100))
    assert a.num_computed_tokens == 4 and a.output_token_ids == [100]
    [out] = s.take_outputs()
    assert (out.request_id, out.new_token_ids, out.finished) == ("a", [100], False)
    batch = s.schedule()  # the 5th token needs a second block
    assert _view(batch) == [("a", 1, 4, True)] and a.block_ids == [0, 1]
    s.postprocess(batch, _tokens(101))
    s.postprocess(s.schedule(), _tokens(102))
    assert a.state is F and a.finish_reason is FinishReason.LENGTH
    outs = s.take_outputs()
    assert [(o.new_token_ids, o.finished, o.finish_reason) for o in outs] == [([101], False, None),
                                                                            ([102], True, "length")]
    assert s.seqs == {} and not s.running and not s.has_work() and a.block_ids == [] and _all_free(s)


def test_a_prefill_publishes_its_full_blocks():
    events: list[KVEvent] = []
    s = Scheduler(BlockManager(8, 4, True, events.append), 8, 64, True)
    a = _seq("a", 9)
    s.add(a)
    s.postprocess(s.schedule(), _tokens(7))
    assert events == [KVEvent("stored", block_hashes(a.prompt_token_ids[:8], 4), None)]


def test_stop_conditions():
    s = _sched(eos_token_ids=frozenset({2}), max_model_len=7)
    seqs = [_seq("eos", 3), _seq("ignore", 3, ignore_eos=True), _seq("id", 3, stop_token_ids=(5,)),
            _seq("window", 6)]
    for q in seqs:
        s.add(q)
    s.postprocess(s.schedule(), _tokens(2, 2, 5, 9))
    assert [(q.state, q.finish_reason, q.stop_reason) for q in seqs] == [
        (F, FinishReason.STOP, None), (R, None, None), (F, FinishReason.STOP, 5), (F, FinishReason.LENGTH, None)]
    assert list(s.seqs) == ["ignore"]


def test_chunked_prefill_takes_the_token_budget_and_samples_on_the_last_chunk():
    s = _sched(max_num_tokens=4)
    a = _seq("a", 10)
    s.add(a)
    views = []
    for _ in range(3):
        batch = s.schedule()
        views += _view(batch)
        s.postprocess(batch, _tokens(*[7 for b in batch if b.samples]))
    assert views == [("a", 4, 0, False), ("a", 4, 4, False), ("a", 2, 8, True)]
    assert a.output_token_ids == [7] and len(a.block_ids) == 3


def test_a_prompt_that_would_leave_a_sliver_waits_for_the_next_step_rather_than_lengthen_this_one():
    """Two 256-token prompts in a 512-token step beside a decode row: the second would get 255 tokens and
    wait a whole further step for its last one. It waits instead, and heads the next step whole."""
    s = _sched(num_blocks=200, max_num_tokens=512)
    d, a, b = _seq("d", 4, max_tokens=30), _distinct("a", 256, 1000), _distinct("b", 256, 2000)
    s.add(d)
    s.postprocess(s.schedule(), _tokens(7))  # d decodes from now on
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert _view(batch) == [("d", 1, 4, True), ("a", 256, 0, True)] and b.state is W
    s.postprocess(batch, _tokens(7, 7))
    assert _view(s.schedule()) == [("d", 1, 5, True), ("a", 1, 256, True), ("b", 256, 0, True)]


def test_a_prompt_alone_beside_decode_rows_is_still_chunked_to_the_budget():
    """The same sliver with no other prompt in the step: the chunk runs (else it could wait forever)."""
    s = _sched(num_blocks=40, max_num_tokens=64)
    d, a = _seq("d", 4, max_tokens=30), _distinct("a", 66, 1000)
    s.add(d)
    s.postprocess(s.schedule(), _tokens(7))
    s.add(a)
    assert _view(s.schedule()) == [("d", 1, 4, True), ("a", 63, 0, False)]


def test_without_chunked_prefill_a_prompt_over_the_budget_waits():
    s = _sched(max_num_tokens=4, chunked=False)
    a = _seq("a", 5)
    s.add(a)
    assert s.schedule() == [] and a.state is W and _all_free(s)


def test_a_cached_prefix_is_shared_not_recomputed():
    s = _sched()
    a = _seq("a", 9, max_tokens=1)
    s.add(a)
    s.postprocess(s.schedule(), _tokens(7))  # a finishes; its two full blocks stay cached
    assert a.state is F and _all_free(s)
    b = _seq("b", 9)
    s.add(b)
    batch = s.schedule()
    assert _view(batch) == [("b", 1, 8, True)]
    assert b.block_ids == [0, 1, 3] and b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    c = _seq("c", 9)
    s.add(c)
    s.schedule()
    assert c.block_ids[:2] == [0, 1] and s.blocks.ref_counts[:2] == [2, 2]


def test_when_blocks_run_out_the_newest_sequence_is_preempted_and_requeued_first():
    s = _sched(num_blocks=4, tpb=2)
    a, b = _seq("a", 3), _seq("b", 3)
    s.add(a)
    s.add(b)
    s.postprocess(s.schedule(), _tokens(7, 7))
    s.postprocess(s.schedule(), _tokens(8, 8))  # 5 tokens each, 4 computed, 2 blocks each: full
    c = _seq("c", 1)
    s.add(c)
    batch = s.schedule()
    assert _view(batch) == [("a", 1, 4, True)]  # and no admission in a step that preempted
    assert b.state is W and b.block_ids == [] and b.num_computed_tokens == 0 and list(s.waiting) == [b, c]
    assert a.block_ids == [0, 1, 3] and s.running == [a]  # b's blocks were freed tail first
    assert b.output_token_ids == [7, 8]  # kept: recomputed with the prompt when readmitted


def test_a_pipelined_context_prefill_reserves_its_prompt_and_is_never_preempted():
    s = _sched(num_blocks=4, tpb=2, max_num_tokens=4)
    a = _seq("a", 2)
    c = _seq("c", 5, rtype=RequestType.CONTEXT_ONLY, disagg=DisaggInfo(7, pipelined=True))
    s.add(a)
    s.add(c)
    batch = s.schedule()
    assert _view(batch) == [("a", 2, 0, True), ("c", 2, 0, False)]
    assert c.block_ids == [1, 2, 3]  # the whole prompt, though only 2 tokens are computed
    s.postprocess(batch, _tokens(7))
    batch = s.schedule()  # a must grow; the newest running sequence is pinned: a gives way itself
    assert _view(batch) == [("c", 3, 2, True)]
    assert a.state is W and c.state is R and c.block_ids == [1, 2, 3]


def test_generation_only_parks_for_its_kv_then_decodes_from_the_first_token():
    s = _sched()
    g = _seq("g", 5, rtype=RequestType.GENERATION_ONLY, disagg=DisaggInfo(5, "tcp://ctx:1", 0, (42,)))
    g.output_token_ids = [42]  # the engine's add_request: the context instance's token is ours
    s.add(g)
    assert s.schedule() == []
    assert g.state is GEN_KV and s.parked == {"g": g} and g.block_ids == [0, 1] and not s.has_work()
    s.kv_arrived(g)
    assert g.state is R and s.running == [g] and not s.parked and g.num_computed_tokens == 5
    [out] = s.take_outputs()
    assert (out.new_token_ids, out.finished) == ([42], False)
    assert _view(s.schedule()) == [("g", 1, 5, True)]


def test_generation_first_the_first_token_comes_with_the_kv_and_may_end_the_request():
    s = _sched()
    g = _seq("g", 5, max_tokens=1, rtype=RequestType.GENERATION_ONLY, logprobs=0,
             disagg=DisaggInfo(5, "tcp://ctx:1", schedule_style="generation_first"))
    s.add(g)
    s.schedule()
    came = FirstToken(42, ({"token_id": 42, "logprob": -0.5, "top": [[42, -0.5]]},)).to_bytes()  # as it rides the KV
    s.kv_arrived(g, FirstToken.from_bytes(came))
    assert g.state is F and g.output_token_ids == [42] and g.output_logprobs[0]["top"] == [(42, -0.5)]
    [out] = s.take_outputs()
    assert (out.new_token_ids, out.finished, out.finish_reason) == ([42], True, "length")
    assert s.seqs == {} and s.by_disagg_id == {} and _all_free(s)


def _context_only(s: Scheduler, **disagg) -> Sequence:
    c = _seq("c", 5, rtype=RequestType.CONTEXT_ONLY, disagg=DisaggInfo(9, **disagg))
    s.add(c)
    s.postprocess(s.schedule(), _tokens(77))
    return c


def test_context_only_answers_after_its_first_token_and_keeps_the_kv_until_the_transfer_ends():
    s = _sched()
    c = _context_only(s)
    assert c.state is CTX_TX and s.parked == {"c": c} and not s.running and c.block_ids == [0, 1]
    [out] = s.take_outputs()
    assert (out.finished, out.finish_reason, out.context) == (True, "length", ContextResult(9, FirstToken(77)))
    assert not s.has_work()  # parked: nothing to step
    s2 = _sched()
    c2 = _context_only(s2)
    s2.take_outputs()
    s2.transfer_ended(c2, None)
    assert c2.state is F and s2.seqs == {} and not s2.parked and _all_free(s2) and s2.take_outputs() == []


def test_release_kv_frees_an_answered_context_request_once():
    s = _sched()
    c = _context_only(s)
    assert s.release_kv(10) is False  # not here
    assert s.release_kv(9) is True
    assert c.state is F and c.finish_reason is FinishReason.ABORT and _all_free(s) and s.cancels == []
    assert s.release_kv(9) is False  # gone


def test_release_kv_leaves_a_context_request_whose_answer_is_still_due():
    s = _sched(max_num_tokens=2)
    c = _seq("c", 5, rtype=RequestType.CONTEXT_ONLY, disagg=DisaggInfo(9))
    s.add(c)
    s.schedule()  # prefilling, chunk 1 of 3
    assert s.release_kv(9) is False and c.state is R


def test_aborting_while_a_transfer_may_write_holds_the_blocks_until_the_cancel_settles():
    s = _sched()
    c = _context_only(s)
    c.disagg.transfer_started = True  # the KV exchange offered it to the generation side
    s.abort("c")
    assert c.state is F and c.finish_reason is FinishReason.ABORT
    assert s.parked == {"c": c} and c.block_ids == [0, 1] and s.cancels == [9]
    assert c.disagg.cancelled_while == "prefilled, its KV waiting for the generation instance to pull it"
    s.abort("c")  # finished already: nothing more
    assert s.release_kv(9) is True and s.cancels == [9]  # the cancel is on its way
    s.take_outputs()
    s.transfer_ended(c, "cancelled")
    assert s.seqs == {} and _all_free(s) and s.take_outputs() == []


def test_aborting_a_running_request_frees_it_at_once():
    s = _sched()
    a = _seq("a", 4)
    s.add(a)
    s.schedule()
    s.abort("a")
    assert a.state is F and a.finish_reason is FinishReason.ABORT and s.seqs == {} and _all_free(s)
    out = s.take_abort_output("a")
    assert (out.finished, out.finish_reason) == (True, "abort") and s.take_abort_output("a") is None
    s.abort("a")  # unknown by now: nothing


def test_a_failed_row_or_a_failed_request_ends_with_its_error():
    s = _sched()
    a, b = _seq("a", 4), _seq("b", 4)
    s.add(a)
    s.add(b)
    s.postprocess(s.schedule(), SampleResult([-1, 7], [None, None], [None, None], ["NaN logits", None]))
    s.fail(b, "the forward step failed: boom")
    outs = s.take_outputs()
    assert [(o.request_id, o.finished, o.finish_reason, o.error) for o in outs] == [
        ("a", True, "error", "NaN logits"), ("b", False, None, None),
        ("b", True, "error", "the forward step failed: boom")]
    assert s.seqs == {} and _all_free(s)
    s.fail(b, "again")  # already retired: nothing
    assert s.take_outputs() == []


def test_a_generation_request_whose_transfer_failed_ends_with_the_reason():
    s = _sched()
    g = _seq("g", 5, rtype=RequestType.GENERATION_ONLY, disagg=DisaggInfo(5, "tcp://ctx:1", 0, (42,)))
    s.add(g)
    s.schedule()
    s.transfer_ended(g, "timed out")
    [out] = s.take_outputs()
    assert (out.finished, out.error) == (True, "KV transfer from tcp://ctx:1 failed: timed out")
    assert g.finish_reason is FinishReason.ERROR and s.seqs == {} and _all_free(s)


def test_cancel_transfer_is_queued_once():
    s = _sched()
    c = _context_only(s)
    s.cancel_transfer(c)
    s.cancel_transfer(c)
    assert s.cancels == [9] and c.disagg.cancelling


def test_a_preempted_generation_request_is_recomputed_not_parked_again():
    """Its KV came once and will not come again: parked for it, it would hang holding its blocks."""
    s = _sched(num_blocks=3, tpb=2)
    g = _seq("g", 2, rtype=RequestType.GENERATION_ONLY, disagg=DisaggInfo(5, "tcp://ctx:1", 0, (42,)))
    g.output_token_ids = [42]
    a = _seq("a", 2, max_tokens=2)
    s.add(g)
    s.add(a)
    s.postprocess(s.schedule(), _tokens(7))  # g parks, a prefills
    g.disagg.transfer_started = g.disagg.transfer_settled = True
    s.kv_arrived(g)
    s.postprocess(s.schedule(), _tokens(8))  # g must grow, is the newest: preempted; a finishes
    assert g.state is W and a.state is F
    s.schedule()
    assert g.state is R
