"""Nemotron-H (Mamba2 + attention + squared-ReLU MLP layers) against transformers, aggregated and
disaggregated.

The Mamba2 layers keep one state slot per sequence (conv inputs and the SSM state); the oracle is
transformers' greedy `generate` on the same random weights, through batching, prefill chunks (the state
carried across them), preemption and TP 2; disaggregated, the state moves with the attention layers' KV.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Resume
from pdserve.testing.disagg import assert_nothing_held, context_first, step_until
from pdserve.testing.tiny_nemotron_h import make_tiny_nemotron_h

from low_precision_oracle import assert_as_accurate, errors

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory, hf_greedy):
    """8 layers: Mamba2, MLP, attention, MLP, Mamba2, MLP, Mamba2, attention."""
    d = make_tiny_nemotron_h(tmp_path_factory.mktemp("nemotron_h") / "m", pattern="M-*-M-M*")
    model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    assert type(model).__name__ == "NemotronHForCausalLM"
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 90, 1, 29)]
    return str(d), prompts, hf_greedy(model, prompts, MAX_NEW)


def _run(d, prompts, **engine) -> list[list[int]]:
    with LLM(EngineConfig(model=d, tokens_per_block=8, **engine)) as llm:
        out = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        blocks = llm.engine.blocks
        assert blocks.num_free_blocks == blocks.num_blocks
        assert blocks.num_free_state_slots == blocks.num_state_slots > 0
    return out


@pytest.mark.parametrize("engine", [
    {},
    {"max_num_tokens": 7},  # prompts in chunks of 7 beside decodes: the state carried across chunks
    {"num_kv_blocks": 16},  # 31 blocks wanted at once: some preempted, recomputed into a fresh slot
    pytest.param({"tensor_parallel_size": 2}, marks=pytest.mark.slow),  # heads and groups cut in two
], ids=["batched", "chunks of 7", "preempted", "tp2"])
def test_greedy_tokens_equal_transformers(nemotron, engine):
    d, prompts, ref = nemotron
    assert _run(d, prompts, **engine) == ref


def test_the_pytorch_recurrence_without_the_native_kernel_equals_transformers(nemotron, monkeypatch):
    """Where the native kernel cannot be built, the Mamba2 layers run their PyTorch path (the chunked scan,
    the batched decode step): transformers' tokens too."""
    from pdserve.kernels import recurrent

    asked = []
    monkeypatch.setattr(recurrent, "load", lambda: asked.append(1))
    d, prompts, ref = nemotron
    assert _run(d, prompts) == ref
    assert asked  # the layers asked for the kernel, and went on without it


def test_bf16_is_as_accurate_as_transformers_bf16(nemotron):
    d, prompts, _ = nemotron
    assert_as_accurate(*errors(d, prompts, "bfloat16", MAX_NEW, tokens_per_block=8))


def test_disaggregated_equals_aggregated(nemotron):
    """The Mamba2 state (conv [x | B | C] and the SSM state) moves with the KV; the generation instance
    decodes as the aggregated engine does, and both sides give every block and slot back."""
    d, prompts, ref = nemotron

    def engine():
        return LLMEngine(EngineConfig(model=d, device="cpu", tokens_per_block=8, num_kv_blocks=64, max_num_seqs=8,
                                      cache_transceiver_config={"backend": "shm", "kv_transfer_timeout_ms": 20000}))

    ctx = engine()
    gen = engine()
    try:
        assert [g.token_ids for g in context_first(ctx, gen, prompts, GREEDY)] == ref
        step_until([ctx, gen], lambda _: not ctx.has_unfinished() and not gen.has_unfinished())
        assert_nothing_held(ctx, gen)
    finally:
        ctx.shutdown()
        gen.shutdown()


def test_a_resumed_request_recomputes_the_mamba2_state_and_goes_on_as_it_would_have(nemotron):
    """Stream migration (`resume`): the tokens another instance sent are recomputed with the prompt, the
    Mamba2 layers' conv and SSM state with them, and the request goes on with the tokens the lost instance
    would have sent; its block and state slot are given back."""
    d, prompts, ref = nemotron
    engine = LLMEngine(EngineConfig(model=d, tokens_per_block=8))
    try:
        engine.add_request(prompts[2], GREEDY, "r", resume=Resume(tuple(ref[2][:5]), 0))
        outs = step_until([engine], lambda outs: any(o.finished for o in outs))
        assert [t for o in outs for t in o.new_token_ids] == ref[2][5:]
        assert engine.blocks.num_free_state_slots == engine.blocks.num_state_slots > 0
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    finally:
        engine.shutdown()
