"""No exception raised while serving one request stops the step loop: a failing forward step fails the
requests it ran (their KV freed, the error naming the cause), a failing sample fails its own request
only, and the engine goes on serving with unchanged greedy tokens.

The failures are injected (the model and the sampler raise on a marked request): what is under test
is the engine's handling of them, not the model."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.config import EngineConfig
from pdserve.engine import sampler
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing import make_tiny_model

POISON = 7  # a prompt holding this token id makes the injected fault fire
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
NUM_KV_BLOCKS = 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=2, num_heads=4, num_kv_heads=2)
    eng = AsyncEngine.from_config(EngineConfig(model=str(d), device="cpu", max_model_len=512,
                                               num_kv_blocks=NUM_KV_BLOCKS, tokens_per_block=8))
    yield eng
    eng.shutdown()


def _params(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


async def _run(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], object]:
    tokens, last = [], None
    async for out in engine.generate(prompt, params):
        tokens += out.new_token_ids
        last = out
    return tokens, last


def _free_blocks(engine: AsyncEngine) -> int:
    return asyncio.run(asyncio.wait_for(engine.call(lambda e: e.blocks.num_free_blocks), 10))


async def _alongside(engine: AsyncEngine, healthy: SamplingParams, faulty: SamplingParams,
                     faulty_prompt: list[int]):
    """A healthy request, and a faulty one that joins it mid-decode, so the two share steps."""
    first = asyncio.Event()
    tokens, last = [], None

    async def run_healthy():
        nonlocal last
        async for out in engine.generate(PROMPT, healthy):
            tokens.extend(out.new_token_ids)
            last = out
            first.set()

    task = asyncio.ensure_future(run_healthy())
    await asyncio.wait_for(first.wait(), 30)
    bad = await _run(engine, faulty_prompt, faulty)
    await asyncio.wait_for(task, 60)
    return (tokens, last), bad


def test_a_failing_forward_step_fails_only_the_request_that_fails(engine, monkeypatch):
    expected, _ = asyncio.run(_run(engine, PROMPT, _params(max_tokens=40)))
    runner = engine.engine.runner
    forward = runner._forward
    failed_steps = []

    def faulty_forward(spec):
        if any(POISON in s.token_ids for s in spec.seqs):
            failed_steps.append(len(spec.seqs))
            raise RuntimeError("injected fault in the forward step")
        return forward(spec)

    monkeypatch.setattr(runner, "_forward", faulty_forward)
    (good, good_last), (bad, bad_last) = asyncio.run(
        _alongside(engine, _params(max_tokens=40), _params(), [POISON] * 5))
    assert failed_steps[0] == 2, "the faulty request never shared a step with the healthy one"
    assert bad_last.finished and bad_last.finish_reason == "error" and bad == []
    assert "injected fault in the forward step" in bad_last.error
    # The step both were in failed; re-run one by one, only the faulty request failed.
    assert good_last.finish_reason == "length" and good == expected
    assert engine.error is None
    assert asyncio.run(_run(engine, PROMPT, _params(max_tokens=40)))[0] == expected
    assert _free_blocks(engine) == NUM_KV_BLOCKS


def test_a_failing_sample_fails_its_request_alone(engine, monkeypatch):
    expected, _ = asyncio.run(_run(engine, PROMPT, _params(max_tokens=40)))
    sample_row = sampler._sample_row
    faults = []

    def faulty_sample_row(row, spec, penalized):
        if spec.seed == 999:
            faults.append(spec.step)
            raise RuntimeError("injected fault in the sampler")
        return sample_row(row, spec, penalized)

    monkeypatch.setattr(sampler, "_sample_row", faulty_sample_row)
    (good, good_last), (_, bad_last) = asyncio.run(
        _alongside(engine, _params(max_tokens=40), SamplingParams(max_tokens=8, temperature=0.5, seed=999), PROMPT))
    assert faults == [0]
    assert bad_last.finish_reason == "error" and "injected fault in the sampler" in bad_last.error
    assert good_last.finish_reason == "length" and good == expected
    assert engine.error is None
    assert _free_blocks(engine) == NUM_KV_BLOCKS


def test_degenerate_sampling_values_keep_the_engine_serving(engine):
    expected, _ = asyncio.run(_run(engine, PROMPT, _params()))
    cases = [dict(temperature=1e-300), dict(temperature=1e-45), dict(top_p=1e-300),
             dict(repetition_penalty=1e-300), dict(temperature=100.0, top_p=1e-300, seed=3)]
    for kw in cases:
        tokens, last = asyncio.run(_run(engine, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, **kw)))
        assert last.finish_reason == "length" and len(tokens) == 8, kw
    # The greedy limit of a vanishing temperature is the greedy answer.
    greedy, _ = asyncio.run(_run(engine, PROMPT, SamplingParams(max_tokens=12, temperature=1e-300, ignore_eos=True)))
    assert greedy == expected
    assert engine.error is None and _free_blocks(engine) == NUM_KV_BLOCKS
