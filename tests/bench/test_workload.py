"""Workload: lengths in range, exact id prompts, calibrated text prompts, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.workload import build_workload, sample_lengths, warmup_request


def test_lengths_fixed_and_ranged():
    rng = np.random.default_rng(0)
    assert sample_lengths(rng, 64, 0.0, 10).tolist() == [64] * 10
    lens = sample_lengths(rng, 100, 0.5, 5000)
    assert lens.min() == 50 and lens.max() == 150  # both ends reachable, nothing outside
    with pytest.raises(ValueError, match="random-range-ratio"):
        sample_lengths(rng, 10, 1.0, 1)
    with pytest.raises(ValueError, match=">= 1"):
        sample_lengths(rng, 0, 0.0, 1)


def test_id_prompts_exact_length_no_special_tokens(bench_tokenizer):
    reqs = build_workload(bench_tokenizer, 6, 40, 8, range_ratio=0.25, seed=3)
    assert [r.index for r in reqs] == list(range(6))
    for r in reqs:
        assert len(r.prompt) == r.prompt_len and 30 <= r.prompt_len <= 50 and 6 <= r.output_len <= 10
        assert not set(r.prompt) & bench_tokenizer.all_special_ids
        assert all(0 <= t < bench_tokenizer.vocab_size for t in r.prompt)
    assert len({tuple(r.prompt[:4]) for r in reqs}) == 6  # no shared prefix for a cache to reuse
    assert reqs == build_workload(bench_tokenizer, 6, 40, 8, range_ratio=0.25, seed=3)
    assert reqs != build_workload(bench_tokenizer, 6, 40, 8, range_ratio=0.25, seed=4)


def test_text_prompts_encode_to_their_recorded_length(bench_tokenizer):
    reqs = build_workload(bench_tokenizer, 4, 60, 8, seed=1, prompt_kind="text")
    for r in reqs:
        assert isinstance(r.prompt, str)
        n = len(bench_tokenizer.encode(r.prompt, add_special_tokens=False))
        assert n == r.prompt_len
        # The tiny BPE merges words less than a real one; still within a few tokens of the target.
        assert 60 - 4 <= n <= 60


def test_warmup_is_short_and_not_a_measured_prompt(bench_tokenizer):
    w = warmup_request(bench_tokenizer, seed=0)
    reqs = build_workload(bench_tokenizer, 3, 16, 2, seed=0)
    assert w.prompt_len == 16 and w.output_len == 2 and all(w.prompt != r.prompt for r in reqs)


def test_bad_workload_args(bench_tokenizer):
    with pytest.raises(ValueError, match="num-prompts"):
        build_workload(bench_tokenizer, 0, 8, 8)
    with pytest.raises(ValueError, match="prompt-kind"):
        build_workload(bench_tokenizer, 1, 8, 8, prompt_kind="json")
