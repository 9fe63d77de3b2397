"""The static decode step (engine/static_decode.py), run on CPU where `static_decode_on_cpu` forces it: the
step CUDA captures as graphs gives exactly the eager step's tokens, logprobs and KV bytes, for batches
padded to a bucket, requests at different positions, joining and leaving between steps; rows with a
logit processor keep their steps eager. Its sampler (static_sampler.py) gives sampler.sample's tokens
row by row. (Its attention kernel on CUDA: test_static_decode_kernel.py; on a GPU: test_static_decode_cuda.py.)"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampler import SampleSpec, sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.static_decode import default_buckets
from pdserve.engine.static_sampler import INT_FIELDS, FLOAT_FIELDS, fill_rows, read_result, sample_static, static_row
from pdserve.testing import make_tiny_model

VOCAB = 300


def test_static_sampler_gives_sample_s_tokens_row_by_row():
    rnd = random.Random(0)
    specs = [SampleSpec(temperature=rnd.choice([0.0, 1e-6, 0.5, 1.0, 1.7]), top_p=rnd.choice([1.0, 0.9, 0.3, 1e-9]),
                        top_k=rnd.choice([-1, 1, 5, 50, VOCAB, VOCAB + 5]), min_p=rnd.choice([0.0, 0.05, 0.5]),
                        seed=rnd.choice([None, 3, -7, 2**62]), step=rnd.randrange(100),
                        logprobs=rnd.choice([None, 0, 3, 20])) for _ in range(48)]
    logits = torch.randn(48, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    logits[3, 5] = float("nan")  # fails alone
    logits[7] = float("-inf")  # nothing left to draw
    specs[7] = SampleSpec(seed=1)
    logits[9, 10] = float("inf")  # the +inf tokens share all the mass
    logits[11, [1, 2]] = float("inf")
    specs[9], specs[11] = SampleSpec(temperature=0.8, seed=2, logprobs=2), SampleSpec(seed=4)
    ints, floats = np.zeros((len(INT_FIELDS), 48), np.int64), np.zeros((len(FLOAT_FIELDS), 48))
    fill_rows(ints, floats, specs, VOCAB, reciprocal=False)
    out = sample_static(logits, torch.from_numpy(ints), torch.from_numpy(floats), True, True, reciprocal=False)
    got, ref = read_result(out.tolist(), specs), sample(logits, specs)
    compared = 0
    for i, s in enumerate(specs):
        if s.seed is None and s.temperature >= 1e-5:  # an unseeded draw: its own stream, a token with mass
            assert got.error(i) is None and torch.softmax(logits[i], -1)[got.token_ids[i]] > 0
            continue
        compared += 1
        assert (got.token_ids[i], got.error(i)) == (ref.token_ids[i], ref.error(i)), (i, s)
        if ref.logprobs[i] is None or not math.isnan(ref.logprobs[i]):  # (NaN: a +inf row's, whose top ids are moot)
            assert (got.logprobs[i], got.top_logprobs[i]) == (ref.logprobs[i], ref.top_logprobs[i]), (i, s)
        else:
            assert math.isnan(got.logprobs[i])
    assert compared > 30 and got.error(3) and got.error(7) and got.token_ids[11] in (1, 2)


def test_rows_with_a_logit_processor_are_not_static():
    assert static_row(SampleSpec(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=3, step=9, logprobs=2))
    assert static_row(SampleSpec(repetition_penalty=1.3))  # no history sent: nothing to penalize
    for processor in ({"repetition_penalty": 1.3, "history": [1, 2]}, {"presence_penalty": 1.0, "output": [3]},
                      {"logit_bias": [(4, 2.0)]}, {"banned": [0]}, {"choices": 2}):
        assert not static_row(SampleSpec(**processor)), processor
    assert not static_row(None)
    assert default_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64] and default_buckets(3) == [1, 2, 3]
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        EngineConfig(cuda_graph_batch_sizes=[0, 4])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=2, num_heads=4, num_kv_heads=2,
                               vocab_size=VOCAB))


def _engine(model: str, static: bool, layout: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=128, num_kv_blocks=48, tokens_per_block=8,
                                  kv_layout=layout, enable_prefix_caching=False, static_decode_on_cpu=static,
                                  cuda_graph_batch_sizes=[1, 2, 4, 8]))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_static_step_gives_the_eager_step_s_tokens_and_kv(tiny, layout):
    """Two engines on the same weights, fed the same requests at the same steps: one eager, one through
    the static step. Five requests at different positions join one per step (mixed steps: eager on both)
    and leave at different lengths, so decode batches of 5 (padded to 8), 4, 3 (to 4), 2 and 1 run; a
    request with a repetition penalty joins later and keeps its steps eager."""
    rnd = random.Random(1)
    prompts = [[rnd.randrange(3, VOCAB) for _ in range(n)] for n in (3, 17, 9, 30, 5, 12)]
    params = [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.9, top_k=20, top_p=0.8, seed=5, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=11, temperature=1.2, min_p=0.05, seed=-3, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=16, temperature=0.7, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.5, ignore_eos=True)]
    joins = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 17: 5}  # step -> request
    eager, static = _engine(tiny, False, layout), _engine(tiny, True, layout)
    outputs: list[dict] = [{}, {}]
    penalized_steps = []
    try:
        for step in range(30):
            for e, out in zip((eager, static), outputs):
                if step in joins:
                    i = joins[step]
                    e.add_request(prompts[i], params[i], request_id=f"r{i}")
                ran = sum(static.runner.static_decode.steps.values())
                for o in e.step():
                    tokens, logprobs = out.setdefault(o.request_id, ([], []))
                    tokens += o.new_token_ids
                    logprobs += o.new_logprobs
            if "r5" in static.seqs and static.seqs["r5"].output_token_ids:  # a decode step with the penalty
                penalized_steps.append(sum(static.runner.static_decode.steps.values()) - ran)
        assert not eager.has_unfinished() and not static.has_unfinished()
        assert outputs[1] == outputs[0]
        assert [len(outputs[0][f"r{i}"][0]) for i in range(6)] == [p.max_tokens for p in params]
        steps = static.runner.static_decode.steps
        assert set(steps) == {1, 2, 4, 8} and steps[8] >= 3, steps  # 5 rows padded to 8, 3 to 4
        assert penalized_steps and not any(penalized_steps)
        assert eager.runner.static_decode is None
        # The padding rows wrote the spare block only: every request block holds the eager engine's bytes.
        n = eager.runner.num_blocks
        assert static.runner.pool.shape[0] == n + 1 and torch.equal(static.runner.pool[:n], eager.runner.pool[:n])
    finally:
        eager.shutdown()
        static.shutdown()
