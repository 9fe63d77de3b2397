"""The engine on the real SmolLM2-135M-Instruct weights against transformers loading the same GGUF.

The oracle loads the GGUF through transformers' own reader (`gguf_file=`), so this also checks
pdserve's GGUF conversion end to end.
"""

from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans",
    "A haiku about autumn leaves:",
    "To make a cup of tea, first",
]
MAX_NEW = 32
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(smollm2_reference, hf_greedy):
    model, tok = smollm2_reference
    prompts = [tok(p).input_ids for p in PROMPTS]
    return prompts, hf_greedy(model, prompts, MAX_NEW)


@pytest.mark.parametrize("tp,pp", [(1, 1), (3, 1), (1, 2), (1, 3)])
def test_greedy_tokens_match_transformers(reference, pdserve_cache, tp, pp):
    prompts, ref = reference
    cfg = EngineConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, cache_dir=str(pdserve_cache),
                       num_threads=1 if tp * pp > 1 else None)
    with LLM(cfg) as llm:
        out = [c.token_ids for c in llm.generate(prompts, GREEDY)]
    assert out == ref


def test_chat_answers_paris(pdserve_cache):
    with LLM(EngineConfig(cache_dir=str(pdserve_cache))) as llm:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        out = llm.generate([llm.tokenizer.encode(prompt, add_special_tokens=False)],
                           SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
