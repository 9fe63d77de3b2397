"""Structured outputs in the engine (engine/guided.py, the sampler's mask) on a tiny random-weight model: every
output under a schema parses and validates (greedy and sampled), the matcher follows preemption and recompute,
a stream resumed from its first tokens goes on as it would have, and a guided request through a disaggregated
pair (both schedule styles) equals the aggregated one."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.guided import Grammars, GuidedError
from pdserve.engine.llm_engine import LLMEngine, RequestError
from pdserve.engine.sampler import SampleSpec, sample
from pdserve.engine.sampling_params import GuidedSpec, SamplingParams
from pdserve.engine.sequence import DisaggInfo, RequestType, Resume
from pdserve.testing import make_tiny_model
from pdserve.testing.disagg import context_first, step_until

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"},
    "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}},
    "required": ["color", "count", "ok", "tag", "items"], "additionalProperties": False}
GUIDED = GuidedSpec("json", json.dumps(SCHEMA))
PROMPTS = [[5, 9, 44, 120, 7], list(range(30, 51)), [300, 301, 17, 88]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=2, num_heads=4, num_kv_heads=2))


@pytest.fixture(scope="module")
def engine(tiny):
    eng = LLMEngine(EngineConfig(model=tiny, tokens_per_block=8, num_kv_blocks=64))
    yield eng
    eng.shutdown()


def _run(eng: LLMEngine, prompts, params, ids=None, **kw) -> dict[str, list[int]]:
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(p, params, rid, **kw)
    got = {rid: [] for rid in ids}
    for o in step_until([eng], lambda outs: {o.request_id for o in outs if o.finished} >= set(ids)):
        if o.request_id in got:
            got[o.request_id] += o.new_token_ids
            assert o.finish_reason != "error", o.error
    return got


def _valid(eng: LLMEngine, tokens: list[int]) -> dict:
    text = eng.tokenizer.decode(tokens)
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    return doc


def test_the_mask_comes_after_bias_and_penalties_and_before_temperature():
    logits = torch.zeros(2, 64)
    logits[:, 7] = 50.0  # the model's favourite, which the grammar forbids
    mask = bytearray(8)
    mask[1] = 0b0000_0110  # tokens 9 and 10 only
    spec = SampleSpec(temperature=0.0, logit_bias=[(7, 100.0), (10, 5.0)], allowed=bytes(mask))
    hot = SampleSpec(temperature=50.0, top_k=1, seed=3, allowed=bytes(mask), logit_bias=[(7, 100.0), (10, 5.0)])
    assert sample(logits, [spec, hot]).token_ids == [10, 10]  # top_k=1 after the mask: the best allowed one
    failed = sample(logits[:1], [SampleSpec(temperature=0.0, allowed=bytes(8))])
    assert failed.token_ids == [-1] and "grammar" in failed.error(0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_parses_and_validates(engine, temperature):
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=11, guided=GUIDED)
    free = _run(engine, PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0), ids=["free"])["free"]
    assert not engine.tokenizer.decode(free).startswith("{")  # the tiny model writes no JSON of its own
    for tokens in _run(engine, PROMPTS[1:], params).values():
        _valid(engine, tokens)
        assert tokens[-1] in engine.eos_token_ids  # EOS came where the grammar may end, and ended it
    assert len(engine.guides) == 0  # every matcher dropped with its sequence


def test_each_choice_of_a_request_has_its_own_matcher(engine):
    """n = 3: the first token of every choice is drawn under the grammar's first mask, then each forked choice
    gets a matcher of its own, started from its first token."""
    engine.add_request(PROMPTS[0], SamplingParams(n=3, max_tokens=60, temperature=1.0, seed=2, guided=GUIDED), "n3")
    outs = step_until([engine], lambda outs: sum(o.finished for o in outs) == 3)
    texts = [[t for o in outs if o.index == c for t in o.new_token_ids] for c in range(3)]
    assert len({tuple(t) for t in texts}) > 1  # the choices went their own ways
    for tokens in texts:
        _valid(engine, tokens)


def test_regex_choice_and_grammar(engine):
    regex = SamplingParams(max_tokens=30, temperature=1.0, seed=5, guided=GuidedSpec("regex", r"[0-9]{3}-[a-c]{2}"))
    lark = GuidedSpec("grammar", 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/')
    out = _run(engine, PROMPTS, regex)
    for tokens in out.values():
        text = engine.tokenizer.decode(tokens)
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and set(text[4:]) <= set("abc"), text
    for tokens in _run(engine, PROMPTS, SamplingParams(max_tokens=10, temperature=1.0, seed=2, guided=lark)).values():
        text = engine.tokenizer.decode(tokens)
        assert text in ("yes", "no") or (text.startswith("maybe ") and text[-1].isdigit()), text


def test_preempted_and_recomputed_sequences_keep_their_grammar(tiny, engine):
    """Three guided sequences in 14 blocks: they preempt one another (recomputing prompt and output) and each
    output equals the one it gets alone."""
    params = SamplingParams(max_tokens=60, temperature=0.0, guided=GUIDED)
    prompts = [[11 + i, 40, 41, 42 + i, 7] for i in range(3)]
    alone = _run(engine, prompts, params)
    small = LLMEngine(EngineConfig(model=tiny, tokens_per_block=8, num_kv_blocks=14))
    try:
        preempted = 0
        orig = small.scheduler._preempt

        def counting(seq):
            nonlocal preempted
            preempted += 1
            orig(seq)

        small.scheduler._preempt = counting
        assert _run(small, prompts, params) == alone
        assert preempted > 0, preempted
    finally:
        small.shutdown()


def test_a_resumed_stream_goes_on_as_it_would_have(engine):
    """A moved stream starts from the tokens its lost instance generated: the matcher is rebuilt from them."""
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=21, guided=GUIDED)
    whole = _run(engine, PROMPTS[1:2], params, ids=["whole"])["whole"]
    cut = len(whole) // 2
    rest = _run(engine, PROMPTS[1:2], params, ids=["moved"], resume=Resume(tuple(whole[:cut]), 0))["moved"]
    assert whole[:cut] + rest == whole
    _valid(engine, whole)
    bad = engine.tokenizer.encode("not json", add_special_tokens=False)
    with pytest.raises(RequestError, match="not allowed") as e:
        engine.add_request(PROMPTS[1], params, "bad", resume=Resume(tuple(bad), 0))
    assert e.value.param == "resume.token_ids"


def test_bad_grammars_are_refused_with_the_field(engine):
    grammars = engine.guides.grammars
    cases = [(GuidedSpec("json", '{"type": "strng"}'), "Invalid type"),
             (GuidedSpec("json", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
             (GuidedSpec("json", "{not json"), "not JSON"),
             (GuidedSpec("regex", "[^\\s\\S]"), "matches no output"),
             (GuidedSpec("regex", "(ab"), "unclosed group"),
             (GuidedSpec("grammar", "start: foo", "structured_outputs.grammar"), "unknown name"),
             (GuidedSpec("grammar", "root ::= (", "structured_outputs.grammar"), "GBNF")]
    for spec, why in cases:
        with pytest.raises(GuidedError, match=why) as e:
            grammars.compile(spec)
        assert e.value.param == spec.param
    with pytest.raises(RequestError, match="cannot be used") as e:
        engine.add_request([5, 6], SamplingParams(guided=cases[0][0]), "x")
    assert e.value.param == "response_format" and "x" not in engine.seqs
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(guided=GUIDED, ignore_eos=True)


def test_a_compiled_grammar_is_cached_by_its_text(engine):
    grammars = Grammars(engine.tokenizer.backend.to_str(), 512, [2])
    first = grammars.compile(GUIDED)
    assert grammars.compile(GuidedSpec("json", json.dumps(SCHEMA), "structured_outputs.json")) is first
    a, b = grammars.guide(GUIDED), grammars.guide(GUIDED)
    a.sync(engine.tokenizer.encode("{", add_special_tokens=False))
    assert a.consumed == 1 and b.consumed == 0  # each sequence its own matcher
    a.sync([])  # the output cut back (a preempted request whose output is recomputed): replayed from the start
    assert a.consumed == 0 and a.mask() == b.mask()


@pytest.fixture(scope="module")
def pair(tiny):
    transceiver = {"backend": "shm", "kv_transfer_timeout_ms": 5000}
    ctx, gen = (LLMEngine(EngineConfig(model=tiny, tokens_per_block=8, num_kv_blocks=64,
                                       cache_transceiver_config=transceiver)) for _ in range(2))
    yield ctx, gen
    ctx.shutdown()
    gen.shutdown()


@pytest.mark.parametrize("style", ["context_first", "generation_first"])
def test_disaggregated_guided_output_equals_aggregated(pair, engine, style):
    """The context instance samples the first token under the grammar; the generation instance's matcher starts
    from it (context_first: at admission; generation_first: when it arrives with the KV) and goes on."""
    params = SamplingParams(max_tokens=100, temperature=1.0, seed=4, guided=GUIDED)
    prompts, n = PROMPTS[:2], 2
    expected = _run(engine, prompts, params)
    ctx, gen = pair
    if style == "context_first":
        got = [g.token_ids for g in context_first(ctx, gen, prompts, params)]
    else:
        for i, p in enumerate(prompts):
            gen.add_request(p, params, f"g{i}", RequestType.GENERATION_ONLY,
                            DisaggInfo(700 + i, ctx.kv_endpoint, schedule_style=style))
            ctx.add_request(p, params, f"c{i}", RequestType.CONTEXT_ONLY, DisaggInfo(700 + i, schedule_style=style))
        outs = step_until([ctx, gen], lambda outs: sum(o.finished and o.request_id[0] == "g" for o in outs) == n)
        got = [[t for o in outs if o.request_id == f"g{i}" for t in o.new_token_ids] for i in range(n)]
    assert got == [expected[f"r{i}"] for i in range(n)]
    for tokens in got:
        _valid(engine, tokens)


def test_a_first_token_the_grammar_refuses_is_a_400(pair, engine):
    """context_first: the generation side checks the context instance's first token against the grammar."""
    _, gen = pair
    x = engine.tokenizer.encode("x", add_special_tokens=False)[0]
    with pytest.raises(RequestError, match="not allowed") as e:
        gen.add_request(PROMPTS[0], SamplingParams(guided=GUIDED), "g", RequestType.GENERATION_ONLY,
                        DisaggInfo(9, "tcp://127.0.0.1:1", first_gen_tokens=(x,)))
    assert e.value.param == "disaggregated_params.first_gen_tokens" and "g" not in gen.seqs
    brace = engine.tokenizer.encode("{", add_special_tokens=False)[0]
    with pytest.raises(RequestError, match="not allowed") as e:  # n > 1: every choice's first token is checked
        gen.add_request(PROMPTS[0], SamplingParams(guided=GUIDED, n=3), "g", RequestType.GENERATION_ONLY,
                        DisaggInfo(9, "tcp://127.0.0.1:1", first_gen_tokens=(brace, brace, x)))
    assert e.value.param == "disaggregated_params.first_gen_tokens" and "g" not in gen.seqs


@pytest.mark.slow
def test_the_mask_reaches_a_sampling_rank_in_another_process(tiny, engine):
    """Pipeline parallel over two ranks: rank 1 (the last stage) samples, rank 0 holds the matchers; the mask
    travels in the step spec, and the output equals the one-process engine's."""
    params = SamplingParams(max_tokens=100, temperature=1.0, seed=8, guided=GUIDED)
    expected = _run(engine, PROMPTS[:2], params)
    pp = LLMEngine(EngineConfig(model=tiny, tokens_per_block=8, num_kv_blocks=64, pipeline_parallel_size=2))
    try:
        assert _run(pp, PROMPTS[:2], params) == expected
    finally:
        pp.shutdown()
