"""Seeded draws: every int64 seed has a stream of its own, a draw depends only on (seed, position), and the
draws follow the distribution they sample. Seeds that differ by a multiple of 2**32, or only in the sign
bit, once drew the same tokens (torch's CPU generator keeps 32 bits of its seed)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.sampler import SampleSpec, sample, seeded_uniform
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing import make_tiny_model

# Seeds that share their low 32 bits, or differ only in bit 63.
COLLIDING = [(7, (1 << 32) + 7), (-1, (1 << 63) - 1), (0, -(1 << 63)), (5, 5 + (3 << 40))]
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


def _spec(**kw) -> SampleSpec:
    return SampleSpec(**({"temperature": 1.0} | kw))


@pytest.mark.parametrize("a,b", COLLIDING, ids=["2**32", "sign-bit", "int64-min", "bit-41"])
def test_seeds_apart_by_high_bits_draw_apart(a, b):
    assert [seeded_uniform(a, n) for n in range(64)] != [seeded_uniform(b, n) for n in range(64)]
    flat = torch.zeros(1, 1000)  # uniform over 1000 tokens: 64 equal draws by chance are out of reach
    draws = [[sample(flat, [_spec(seed=s, step=n)]).token_ids[0] for n in range(64)] for s in (a, b)]
    assert draws[0] != draws[1]


def test_a_draw_depends_on_seed_and_position_only():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    alone = [sample(logits[i:i + 1], [_spec(seed=99, step=i)]).token_ids[0] for i in range(5)]
    batch = [_spec(seed=99, step=i) if i % 2 == 0 else _spec(seed=i, step=40, top_k=5) for i in range(5)]
    together = sample(logits, batch).token_ids
    assert together[0::2] == alone[0::2]  # neighbours in the batch change nothing
    assert sample(logits[3:4], [_spec(seed=99, step=3)]).token_ids[0] == alone[3]  # nor draws before it


def test_seeded_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    row = probs.log().unsqueeze(0)
    n = 4000
    counts = torch.bincount(torch.tensor([sample(row, [_spec(seed=3, step=k)]).token_ids[0] for k in range(n)]),
                            minlength=5)
    assert counts[1] == 0  # no mass, never drawn
    # Each count within 5 standard deviations of its binomial mean.
    sd = (n * probs * (1 - probs)).sqrt()
    assert ((counts - n * probs).abs() <= 5 * sd + 1).all(), counts.tolist()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=2, num_heads=4, num_kv_heads=2)
    eng = AsyncEngine.from_config(EngineConfig(model=str(d), device="cpu", max_model_len=256,
                                               num_kv_blocks=64, tokens_per_block=8))
    yield eng
    eng.shutdown()


def _tokens(engine: AsyncEngine, seed: int) -> list[int]:
    async def run():
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        return [t async for out in engine.generate(PROMPT, params) for t in out.new_token_ids]

    return asyncio.run(asyncio.wait_for(run(), 60))


@pytest.mark.parametrize("a,b", COLLIDING[:3], ids=["2**32", "sign-bit", "int64-min"])
def test_the_engine_draws_other_tokens_for_seeds_apart_by_high_bits(engine, a, b):
    first = _tokens(engine, a)
    assert first == _tokens(engine, a)  # reproducible
    assert first != _tokens(engine, b)
