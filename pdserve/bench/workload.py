"""The requests of one benchmark run: prompt lengths, output lengths and the prompts themselves.

Lengths are fixed, or uniform in [len·(1 − r), len·(1 + r)] with --random-range-ratio r (vLLM's
random dataset). Two prompt kinds, both built with the served model's tokenizer:

- "ids": random ordinary token ids sent as the prompt's id list. The input length is exact and
  no re-tokenization can change it; vLLM and pdserve accept id prompts on /v1/completions.
- "text": random whole words from the tokenizer's vocabulary (" the", " model", ...), cut to the
  longest prefix that encodes to at most the target length. Use it for endpoints that take text
  only; the length is then exact up to the tokenizer's merges across word boundaries.

Every prompt starts at a random place, so no two share a prefix a prefix cache could reuse.
Output length is pinned with max_tokens + ignore_eos (+ min_tokens, for servers that know it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import numpy as np

from pdserve.tokenizer import Tokenizer

PromptKind = Literal["ids", "text"]
_WORD = re.compile(r"^ [a-z]{2,12}$")


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    prompt: list[int] | str
    prompt_len: int  # tokens, as the benchmark's tokenizer counts them (no BOS)
    output_len: int


def sample_lengths(rng: np.random.Generator, mean_len: int, range_ratio: float, n: int) -> np.ndarray:
    """n lengths, uniform integers in [floor(mean·(1−r)), ceil(mean·(1+r))], each at least 1."""
    if mean_len < 1:
        raise ValueError(f"lengths must be >= 1 token, got {mean_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(np.floor(mean_len * (1.0 - range_ratio))))
    high = max(low, int(np.ceil(mean_len * (1.0 + range_ratio))))
    return rng.integers(low, high + 1, size=n)


def ordinary_token_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Every id that is not a special token: what random id prompts draw from."""
    ids = np.arange(tokenizer.vocab_size)
    special = np.fromiter(tokenizer.all_special_ids, dtype=np.int64)
    return ids[~np.isin(ids, special)]


def word_token_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Ids whose text is one space plus a lowercase word: each is one token on its own."""
    ids = ordinary_token_ids(tokenizer)
    words = [i for i in ids.tolist() if _WORD.match(tokenizer.decode([i]))]
    if len(words) < 16:
        raise ValueError(f"the tokenizer has only {len(words)} whole-word tokens, too few for random text "
                         "prompts; use --prompt-kind ids")
    return np.asarray(words)


def calibrated_text(tokenizer: Tokenizer, words: list[str], target_len: int) -> tuple[str, int]:
    """The longest prefix of `words` whose text encodes to <= target_len tokens, and its length.

    Binary search on the word count: the encoded length grows with every added word.
    """
    def length(k: int) -> int:
        return len(tokenizer.encode("".join(words[:k]).lstrip(), add_special_tokens=False))

    lo, hi = 0, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length(mid) <= target_len:
            lo = mid
        else:
            hi = mid - 1
    return "".join(words[:lo]).lstrip(), length(lo)


def build_workload(tokenizer: Tokenizer, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, seed: int = 0, prompt_kind: PromptKind = "ids") -> list[WorkloadRequest]:
    """num_prompts requests, the same for the same arguments and tokenizer."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    if prompt_kind == "ids":
        pool = ordinary_token_ids(tokenizer)
        return [WorkloadRequest(i, rng.choice(pool, size=int(n)).tolist(), int(n), int(m))
                for i, (n, m) in enumerate(zip(in_lens, out_lens))]
    if prompt_kind == "text":
        pool = word_token_ids(tokenizer)
        out = []
        for i, (n, m) in enumerate(zip(in_lens, out_lens)):
            # Words mostly encode to one token each; 25% spare covers merges that take two.
            words = [tokenizer.decode([t]) for t in rng.choice(pool, size=int(n * 1.25) + 8).tolist()]
            text, actual = calibrated_text(tokenizer, words, int(n))
            out.append(WorkloadRequest(i, text, actual, int(m)))
        return out
    raise ValueError(f"--prompt-kind must be 'ids' or 'text', got {prompt_kind!r}")


def warmup_request(tokenizer: Tokenizer, seed: int, prompt_kind: PromptKind = "ids") -> WorkloadRequest:
    """A short request of the run's prompt kind from its own random stream, so it warms the server
    without caching a prefix of any measured prompt."""
    rng = np.random.default_rng([seed, 0x77A4])
    ids = rng.choice(ordinary_token_ids(tokenizer), size=16).tolist()
    if prompt_kind == "text":
        return WorkloadRequest(-1, tokenizer.decode(ids), 16, 2)
    return WorkloadRequest(-1, ids, 16, 2)
