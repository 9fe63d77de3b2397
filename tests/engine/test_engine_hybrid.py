"""A hybrid model (Qwen3.5: Gated DeltaNet layers and gated full attention) against transformers.

The recurrent layers keep one state slot per sequence. Their output must not depend on how the
engine cuts the work: batched or alone, a prompt in chunks of any size (1 included), preempted and
recomputed, tensor- or pipeline-parallel. The oracle is transformers' greedy `generate` on the same
random weights (tiny models written by `make_tiny_model(arch="qwen3_5")`).
"""

from __future__ import annotations

import logging

import httpx
import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Resume
from pdserve.testing import make_tiny_model
from pdserve.testing.disagg import step_until

from low_precision_oracle import assert_as_accurate, errors
from served import assert_greedy_completions, pdserve_serve

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, hf_greedy):
    """8 layers: DeltaNet 0-2, attention 3, DeltaNet 4-6, attention 7."""
    d = make_tiny_model(tmp_path_factory.mktemp("qwen3_5") / "m", arch="qwen3_5", num_layers=8, num_heads=4,
                        num_kv_heads=2, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 40, 1, 29)]
    return d, prompts, hf_greedy(model, prompts, MAX_NEW)


def _run(d, prompts, **engine) -> list[list[int]]:
    with LLM(EngineConfig(model=str(d), tokens_per_block=8, **engine)) as llm:
        out = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        blocks = llm.engine.blocks
        assert blocks.num_free_blocks == blocks.num_blocks  # every KV block back
        assert blocks.num_free_state_slots == blocks.num_state_slots > 0  # every state slot back
    return out


@pytest.mark.parametrize("engine", [
    {},
    {"max_num_seqs": 1},
    {"max_num_tokens": 7},  # prompts in chunks of 7 beside decodes: the state carried across chunks
    {"max_num_tokens": 1},  # one token a step: every prompt in chunks of 1
], ids=["batched", "one at a time", "chunks of 7", "chunks of 1"])
def test_greedy_tokens_equal_transformers(hybrid, engine):
    d, prompts, ref = hybrid
    assert _run(d, prompts, **engine) == ref


def test_the_pytorch_recurrence_without_the_native_kernel_equals_transformers(hybrid, monkeypatch):
    """Where the native kernel cannot be built, the DeltaNet layers run their PyTorch path (the chunked rule,
    the batched decode step): transformers' tokens too."""
    from pdserve.kernels import recurrent

    asked = []
    monkeypatch.setattr(recurrent, "load", lambda: asked.append(1))
    d, prompts, ref = hybrid
    assert _run(d, prompts, max_num_tokens=7) == ref
    assert asked  # the layers asked for the kernel, and went on without it


def test_preemption_recomputes_the_state(hybrid):
    """8 blocks of 8 tokens cannot hold the five sequences: some are preempted, their state slot freed,
    and recomputed from their first token into a fresh slot."""
    d, prompts, ref = hybrid
    assert _run(d, prompts, num_kv_blocks=8) == ref


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_parallel_layouts_equal_transformers(hybrid, layout):
    """TP2 cuts every DeltaNet section ([q | k | v] and the conv) and the attention by heads; PP2 gives each
    stage three DeltaNet layers and one attention layer."""
    d, prompts, ref = hybrid
    assert _run(d, prompts, **layout) == ref


def test_bf16_is_as_accurate_as_transformers_bf16(hybrid):
    """bf16: tokens part ways on near-ties, so the oracle is accuracy. Teacher-forced on the tokens pdserve
    chose, pdserve's log-probabilities are as close to transformers' fp32 ones as transformers' own bf16."""
    d, prompts, _ = hybrid
    assert_as_accurate(*errors(d, prompts, "bfloat16", MAX_NEW, tokens_per_block=8))


def test_prefix_caching_is_off_with_one_line_saying_why(hybrid, caplog):
    d, prompts, ref = hybrid
    with caplog.at_level(logging.INFO, logger="pdserve.engine.llm_engine"):
        with LLM(EngineConfig(model=str(d), tokens_per_block=8)) as llm:
            first, second = llm.generate([prompts[2], prompts[2]], GREEDY)
            again = llm.generate([prompts[2]], GREEDY)[0]
    assert [r.message for r in caplog.records].count(
        "prefix caching is off for this hybrid model: its recurrent layers' state is kept for the whole sequence "
        "only, not at block boundaries, so a cached prefix could not resume it") == 1
    assert again.num_cached_tokens == 0
    assert first.token_ids == second.token_ids == again.token_ids == ref[2]



def test_pdserve_serve_answers_the_openai_client_as_transformers_does(hybrid):
    """`pdserve serve DIR` of the hybrid model, asked through the OpenAI client: the greedy completion of
    each prompt (token ids in, all sent at once) is transformers' text, and /metrics counts its state slots."""
    d, prompts, ref = hybrid
    with pdserve_serve(d, "--tokens-per-block", "8", "--max-num-seqs", "4") as url:
        assert_greedy_completions(url, d, prompts, ref, MAX_NEW)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert "pdserve_state_slots_total 4.0" in metrics and "pdserve_state_slots_free 4.0" in metrics


@pytest.mark.parametrize("cut", [1, 7])
def test_a_resumed_request_recomputes_the_state_and_goes_on_as_it_would_have(hybrid, cut):
    """Stream migration (`resume`): another instance's output so far is recomputed with the prompt, the
    recurrent state with it, and the request goes on with the tokens the lost instance would have sent."""
    d, prompts, ref = hybrid
    engine = LLMEngine(EngineConfig(model=str(d), tokens_per_block=8))
    try:
        engine.add_request(prompts[2], GREEDY, "r", resume=Resume(tuple(ref[2][:cut]), 0))
        outs = step_until([engine], lambda outs: any(o.finished for o in outs))
        assert [t for o in outs for t in o.new_token_ids] == ref[2][cut:]
    finally:
        engine.shutdown()


def test_an_aborted_request_gives_its_state_slot_back_and_the_others_go_on(hybrid):
    """Aborted mid-decode (a client gone): its blocks and its state slot are free at once, and the requests
    decoding beside it, whose slots the freed one sat among, still give transformers' tokens."""
    d, prompts, ref = hybrid
    engine = LLMEngine(EngineConfig(model=str(d), tokens_per_block=8, max_num_seqs=3))
    try:
        for i in (0, 1, 2):
            engine.add_request(prompts[i], GREEDY, f"r{i}")
        outs = step_until([engine], lambda outs: sum(1 for o in outs if o.request_id == "r1") >= 4)
        engine.abort("r1")
        engine.take_abort_output("r1")
        assert engine.blocks.num_free_state_slots == 1
        engine.add_request(prompts[4], GREEDY, "r4")  # takes the freed slot while r0 and r2 decode
        outs += step_until([engine], lambda _: not engine.has_unfinished())
        got = {rid: [t for o in outs if o.request_id == rid for t in o.new_token_ids] for rid in ("r0", "r2", "r4")}
        assert got == {"r0": ref[0], "r2": ref[2], "r4": ref[4]}
        assert engine.blocks.num_free_state_slots == engine.blocks.num_state_slots == 3
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    finally:
        engine.shutdown()
