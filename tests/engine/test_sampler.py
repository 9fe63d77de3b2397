"""The sampler's logit adjustments against values worked out by hand: repetition, presence and
frequency penalties and logit bias, in that order; logprobs stay the model's own."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import SampleSpec, _adjust, sample
from pdserve.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([[2.0, 1.9, -1.0, 0.5, 1.0]])


def _spec(**kw) -> SampleSpec:
    base = dict(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, seed=None, step=0,
                logprobs=None, history=None)
    return SampleSpec(**(base | kw))


def test_adjustments_worked_by_hand():
    spec = _spec(repetition_penalty=2.0, history=[0, 2, 0], presence_penalty=0.5, frequency_penalty=0.25,
                 output=[1, 3, 1], logit_bias=[(4, 3.0), (0, -1.0)])
    # repetition (tokens 0 and 2 seen): 2.0 / 2 = 1.0, -1.0 * 2 = -2.0
    # presence and frequency (output: token 1 twice, token 3 once): 1.9 - 0.5 - 2 * 0.25 = 0.9, 0.5 - 0.5 - 0.25
    # logit bias: 1.0 - 1.0 = 0.0 for token 0, 1.0 + 3.0 for token 4
    expected = torch.tensor([0.0, 0.9, -2.0, -0.25, 4.0])
    torch.testing.assert_close(_adjust(LOGITS[0], spec), expected)
    assert sample(LOGITS, [spec]).token_ids == [4]


def test_adjusted_and_plain_rows_in_one_batch():
    logits = LOGITS.repeat(3, 1)
    specs = [_spec(), _spec(logit_bias=[(2, 10.0)]), _spec(presence_penalty=1.0, output=[0])]
    assert sample(logits, specs).token_ids == [0, 2, 1]  # 2.0 - 1.0 = 1.0 < 1.9


def test_logprobs_are_the_models_own():
    out = sample(LOGITS, [_spec(logit_bias=[(2, 100.0)], logprobs=1)])
    raw = torch.log_softmax(LOGITS[0], -1)
    assert out.token_ids == [2] and out.logprobs[0] == pytest.approx(float(raw[2]))
    assert out.top_logprobs[0] == [(0, pytest.approx(float(raw[0])))]


def test_sampling_params_check_the_new_fields():
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0}
    for kw, message in [({"presence_penalty": 2.5}, "presence_penalty must be in"),
                        ({"frequency_penalty": -2.1}, "frequency_penalty must be in"),
                        ({"logit_bias": {-1: 1.0}}, "token ids must be >= 0"),
                        ({"logit_bias": {3: 101.0}}, "values must be in")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kw)


def test_stop_token_ids_are_kept_once_each():
    """Each sampled token is looked up in stop_token_ids, and while min_tokens holds them back they are
    banned afresh every step: a request repeating 48 K ids 85 times (4 M in 25 MiB of JSON) made every step
    scan them all, 7.5 s for 32 tokens (benchmarks/hostile_bodies.py)."""
    p = SamplingParams(stop_token_ids=[7, 3, 7, 7, 0, 3] * 1000)
    assert p.stop_token_ids == (0, 3, 7) and p.stop_token_set == {0, 3, 7}
    assert p == SamplingParams(stop_token_ids=[0, 3, 7]) and hash(p) == hash(SamplingParams(stop_token_ids=[7, 3, 0]))


def test_banned_tokens_are_never_drawn():
    spec = _spec(banned=[0, 1])
    torch.testing.assert_close(_adjust(LOGITS[0], spec)[:2], torch.full((2,), float("-inf")))
    assert sample(LOGITS, [spec]).token_ids == [4]
    drawn = {sample(LOGITS, [_spec(temperature=5.0, seed=i, banned=[0, 1, 4])]).token_ids[0] for i in range(40)}
    assert drawn == {2, 3}


# Legal but degenerate values: each once made torch.multinomial raise and stopped the engine's step loop.
ROW = torch.tensor([[3.0, 2.5, -1.0, 0.5, 1.0, 2.9]])


@pytest.mark.parametrize("kw", [dict(temperature=1e-300), dict(temperature=1e-45), dict(temperature=1e-6),
                                dict(temperature=1.0, top_p=1e-300), dict(temperature=100.0, top_p=1e-300)],
                         ids=["temp-1e-300", "temp-1e-45", "temp-1e-6", "top-p-1e-300", "hot-top-p-1e-300"])
def test_degenerate_values_sample_their_limit(kw):
    """A temperature under GREEDY_BELOW is greedy, and a top_p that rounds to 0 keeps the likeliest token."""
    for seed in (None, 7):
        out = sample(ROW, [_spec(seed=seed, **kw)])
        assert out.token_ids == [0] and out.errors is None


def test_a_repetition_penalty_that_overflows_keeps_its_meaning():
    # 1e-300 divides the positive seen logits to +inf: they share the mass; negative seen ones go to -0.
    for seed in range(8):
        out = sample(ROW, [_spec(temperature=1.0, seed=seed, repetition_penalty=1e-300, history=[1, 4, 2])])
        assert out.token_ids[0] in (1, 4) and out.errors is None
    assert sample(ROW, [_spec(repetition_penalty=1e-300, history=[1, 4, 2])]).token_ids[0] in (1, 4)


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = ROW.repeat(3, 1)
    logits[1, 2] = float("nan")
    specs = [_spec(temperature=1.0, seed=1, logprobs=1), _spec(logprobs=1),
             _spec(temperature=1.0, banned=list(range(ROW.shape[1])))]
    out = sample(logits, specs)
    assert out.token_ids[1:] == [-1, -1] and 0 <= out.token_ids[0] < ROW.shape[1]
    assert out.errors[0] is None and out.logprobs[0] is not None
    assert "NaN" in out.errors[1] and out.logprobs[1] is None
    assert "no token is left to sample" in out.errors[2]


def test_greedy_below_the_threshold_is_greedy():
    assert SamplingParams(temperature=1e-300).greedy and not SamplingParams(temperature=1e-4).greedy
