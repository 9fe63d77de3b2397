"""bf16 and fp16 weights: greedy tokens cannot be compared with transformers' token for token (in
bf16 the two part ways within a few tokens on near-ties, both being right to the precision they
have), so the oracle is accuracy. Teacher-forced on the tokens pdserve generated, transformers in fp32
gives the reference log-probabilities; pdserve's log-probability of each token it chose must be as
close to that as transformers' own forward in the same dtype is."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing import make_tiny_model
from pdserve.testing.disagg import context_first

from low_precision_oracle import assert_as_accurate, errors, errors_of

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

MAX_NEW = 32
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=0)


def _errors(model_dir, prompts: list[list[int]], dtype: str, **engine) -> tuple[torch.Tensor, torch.Tensor]:
    return errors(model_dir, prompts, dtype, MAX_NEW, **engine)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", num_layers=4, num_heads=8,
                        num_kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(1234)
    return d, [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 17, 40, 64, 9, 33, 75, 1)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("batch", ["batched", "one at a time"])
def test_tiny_model_as_accurate_as_transformers(tiny, dtype, batch):
    d, prompts = tiny
    seqs = {"max_num_seqs": 1} if batch == "one at a time" else {}  # one sequence: the one-call layer stack
    assert_as_accurate(*_errors(d, prompts, dtype, tokens_per_block=8, **seqs))


def test_fp32_context_bf16_generation_as_accurate_as_transformers_bf16(tiny):
    """Weight dtypes differ between the instances, the KV dtype is shared: a context instance with fp32
    weights (fast prefill on CPU) hands bf16 KV to a generation instance with bf16 weights."""
    d, prompts = tiny

    def engine(dtype):
        return LLMEngine(EngineConfig(model=str(d), dtype=dtype, kv_cache_dtype="bfloat16", tokens_per_block=8,
                                      num_kv_blocks=128, cache_transceiver_config={"backend": "shm"}))

    ctx, gen = engine("float32"), engine("bfloat16")
    try:
        outs = context_first(ctx, gen, prompts, GREEDY)
        assert (gen.blocks.num_free_blocks == gen.blocks.num_blocks
                and ctx.blocks.num_free_blocks == ctx.blocks.num_blocks)
    finally:
        ctx.shutdown()
        gen.shutdown()
    assert_as_accurate(*errors_of(d, prompts, outs, "bfloat16"))


@pytest.mark.slow
def test_tiny_model_bf16_tp2_pp2_as_accurate_as_transformers(tiny):
    """The TP all-reduces and the PP hand-offs carry bf16 activations."""
    d, prompts = tiny
    assert_as_accurate(*_errors(d, prompts, "bfloat16", tokens_per_block=8, tensor_parallel_size=2,
                                 pipeline_parallel_size=2, num_threads=1))


@pytest.mark.slow
def test_smollm2_bf16_as_accurate_as_transformers(pdserve_cache, smollm2_path):
    from pdserve.weights.resolve import resolve_model

    d = resolve_model(str(smollm2_path), cache_dir=pdserve_cache)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
             "In 1492,", "Water boils at", "The quick brown fox", "To make a cake, you"]
    assert_as_accurate(*_errors(d, [tok(t).input_ids for t in texts], "bfloat16", cache_dir=str(pdserve_cache)))
