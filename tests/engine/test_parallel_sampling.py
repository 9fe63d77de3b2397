"""`n > 1`: a request's prompt is computed once, then forked into n choices that share its full KV blocks
and get copies of its partial last block and of its recurrent state (hybrid models).

The oracle for every choice is transformers on the same weights, each choice drawing its tokens with
the seeded stream the sampler gives it (`seeded_uniform(seed, step, choice)`): a choice whose copied
block or state were wrong, shared with another choice, or stale would pick other tokens.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine, RequestError
from pdserve.engine.sampler import _inverse_cdf, seeded_uniform
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import DisaggInfo, RequestType, Resume
from pdserve.testing import make_tiny_model
from pdserve.testing.disagg import assert_nothing_held, handoff, step_until
from pdserve.testing.tiny_nemotron_h import make_tiny_nemotron_h

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

NEW, SEED, N = 6, 7, 3
SEEDED = SamplingParams(max_tokens=NEW, temperature=1.0, seed=SEED, n=N, ignore_eos=True)


@torch.inference_mode()
def _hf_seeded(model, prompt: list[int], choice: int) -> list[int]:
    """transformers' logits, drawn from as the engine's sampler draws for choice `choice` at temperature 1."""
    ids = list(prompt)
    for step in range(NEW):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        ids.append(_inverse_cdf(torch.softmax(logits, -1), seeded_uniform(SEED, step, choice)))
    return ids[len(prompt):]


def _family(make, path, prompts_lengths=(16, 11)):
    d = make(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(99)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in prompts_lengths]
    return d, prompts, [[_hf_seeded(model, p, c) for c in range(N)] for p in prompts]


@pytest.fixture(scope="module", params=["llama", "qwen3_5", "nemotron_h"])
def family(request, tmp_path_factory):
    """A prompt of two whole 8-token blocks (nothing to copy but the state) and one of 11 (a partial block)."""
    path = tmp_path_factory.mktemp(request.param) / "m"
    if request.param == "nemotron_h":
        return _family(lambda p: make_tiny_nemotron_h(p, pattern="M*-M"), path)
    return _family(lambda p: make_tiny_model(p, arch=request.param, num_layers=4, num_heads=4, num_kv_heads=2,
                                             head_dim=16), path)


def _choices(d, prompts, **engine) -> list[list[list[int]]]:
    with LLM(EngineConfig(model=str(d), tokens_per_block=8, **engine)) as llm:
        out = [[c.token_ids for c in r.choices] for r in llm.generate(prompts, SEEDED)]
        blocks = llm.engine.blocks
        assert blocks.num_free_blocks == blocks.num_blocks  # every choice's blocks back, the shared ones too
        assert blocks.num_free_state_slots == blocks.num_state_slots
    return out


@pytest.mark.parametrize("engine", [{}, {"max_num_seqs": 2}], ids=["forked", "some choices recomputed"])
def test_every_choice_draws_what_transformers_gives(family, engine):
    """Forked: each choice decodes on from the prompt's shared KV. max_num_seqs 2: a choice that finds no
    batch row waits and is computed from its prompt, as a preempted request is."""
    d, prompts, ref = family
    got = _choices(d, prompts, **engine)
    assert got == ref
    assert all(len({tuple(c) for c in choices}) > 1 for choices in got)  # the choices drew apart


def test_every_choice_split_context_first_draws_what_transformers_gives(family):
    """Disaggregated (two engines in one process, real shm transfers): the context engine draws each choice's
    first token from the prompt's logits and answers with them all (one KV transfer); the generation engine
    forks the other choices from the KV that arrived, the recurrent state copied per choice. max_num_seqs 2 on
    the generation side: a choice that finds no batch row waits and is computed from its prompt."""
    d, prompts, ref = family
    shm = {"backend": "shm", "kv_transfer_timeout_ms": 5000}
    ctx = LLMEngine(EngineConfig(model=str(d), tokens_per_block=8, cache_transceiver_config=shm))
    gen = LLMEngine(EngineConfig(model=str(d), tokens_per_block=8, cache_transceiver_config=shm, max_num_seqs=2))
    try:
        for i, p in enumerate(prompts):
            ctx.add_request(p, SEEDED, f"c{i}", RequestType.CONTEXT_ONLY, DisaggInfo(100 + i))
        answered = step_until([ctx], lambda outs: sum(o.finished for o in outs) == len(prompts))
        answers = {o.request_id: o for o in answered}
        assert all(len(a.context.other_choices) == N - 1 for a in answers.values())
        for i, p in enumerate(prompts):
            gen.add_request(p, SEEDED, f"g{i}", RequestType.GENERATION_ONLY, handoff(ctx, answers[f"c{i}"]))
        got = [[[] for _ in range(N)] for _ in prompts]
        for o in step_until([ctx, gen], lambda _: not ctx.has_unfinished() and not gen.has_unfinished()):
            if o.request_id.startswith("g"):
                got[int(o.request_id[1:])][o.index] += o.new_token_ids
        assert got == ref
        assert_nothing_held(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_choice_zero_is_the_request_with_n_1(tmp_path):
    """A seeded request's first choice is the same request with n = 1; greedy choices are all alike."""
    d = make_tiny_model(tmp_path / "m", arch="llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    prompt = list(range(3, 14))
    with LLM(EngineConfig(model=str(d), tokens_per_block=8)) as llm:
        one, many = llm.generate([prompt, prompt], [SamplingParams(max_tokens=NEW, temperature=1.0, seed=SEED,
                                                                   ignore_eos=True), SEEDED])
        assert one.choices == [] and many.choices[0].token_ids == one.token_ids
        greedy = llm.generate([prompt], SamplingParams(max_tokens=NEW, temperature=0.0, n=4, ignore_eos=True))[0]
        assert len(greedy.choices) == 4 and all(c.token_ids == greedy.token_ids for c in greedy.choices)


def test_abort_ends_every_choice_and_frees_their_blocks(tmp_path):
    d = make_tiny_nemotron_h(tmp_path / "m", pattern="M*")
    engine = LLMEngine(EngineConfig(model=str(d), tokens_per_block=8))
    try:
        rid = engine.add_request(list(range(3, 14)), SamplingParams(max_tokens=50, n=4, ignore_eos=True))
        seen = set()
        while len(seen) < 4:  # every choice has produced a token
            seen |= {o.index for o in engine.step()}
        assert len(engine.scheduler.running) == 4
        engine.abort(rid)
        last = engine.take_abort_output(rid)
        assert last is not None and last.finished and last.finish_reason == "abort"
        assert not engine.scheduler.seqs and not engine.scheduler.trackers
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        assert engine.blocks.num_free_state_slots == engine.blocks.num_state_slots
    finally:
        engine.shutdown()


def test_n_is_refused_where_it_cannot_be_honoured(tmp_path):
    d = make_tiny_model(tmp_path / "m", arch="llama", num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 128\]"):
        SamplingParams(n=0)
    engine = LLMEngine(EngineConfig(model=str(d), tokens_per_block=8))
    try:
        with pytest.raises(RequestError, match="n > 1 is served from the start") as e:
            engine.add_request([5, 6], SamplingParams(n=2), resume=Resume((7,), 0))
        assert e.value.param == "n"
        engine.add_request([5, 6], SamplingParams(n=2, max_tokens=4), request_id="x")
        engine.step()  # x's prompt, and its fork
        with pytest.raises(RequestError, match="already in flight"):  # the id of x's second choice
            engine.add_request([5, 6], SamplingParams(max_tokens=4), request_id="x/choice1")
    finally:
        engine.shutdown()
