"""The sampler of the static decode step: sampler.sample's arithmetic on a whole padded batch at once,
with every per-row choice a tensor, so the step reads nothing back to the host (a CUDA graph can hold it).

A row samples here when sampler.sample would take it without a logit processor: greedy, temperature,
top-k, top-p, min-p, seeded or unseeded draws, logprobs. Rows with a repetition, presence or
frequency penalty, a logit bias, min_tokens' banned tokens or a fork into several choices are not
`static_row`s: their step stays eager.

Each row goes through the same ops as sampler.sample applies to it alone, in the same order and dtype,
so a row gets the same token (tested on CPU): an op the eager path skips for a row (top-k off, min-p
0, top-p 1) is applied as a no-op (a mask that masks nothing, a softmax of the same values). Two
differences are by design: an unseeded draw races exponentials (argmax of probs / Exp(1), the same
distribution as torch.multinomial, but another stream), and where equal probabilities straddle the
top-p cut, which of them is cut may differ (the batched sort orders ties its own way).

The step's outputs are one float64 tensor [rows, 3 + 2 * TOP_LOGPROBS] (`Columns`), read back once.
"""

from __future__ import annotations

import functools
from dataclasses import fields

import numpy as np
import torch

from pdserve.engine.sampler import SampleResult, SampleSpec, sample, seeded_uniform
from pdserve.engine.sampling_params import GREEDY_BELOW

TOP_LOGPROBS = 20  # the most top alternatives a request may ask for (SamplingParams.logprobs)
# The SampleSpec fields this sampler reads. A row whose every other field holds its default samples here;
# any other value there (a penalty's history or output, a logit bias, banned or allowed tokens, a fork into
# several choices, or a field added since) is a logit processor of the eager sampler's, and the step stays eager.
_READ = frozenset({"temperature", "top_p", "top_k", "min_p", "seed", "step", "logprobs", "choice",
                   "repetition_penalty", "presence_penalty", "frequency_penalty"})  # (penalties act through
# history and output only)
# The float64 inputs of a row, in this order (`floats` [fields, rows], filled by fill_row)
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "uniform")
# The int64 inputs of a row (`ints` [fields, rows]): top_k (the vocabulary when off), greedy, seeded
INT_FIELDS = ("top_k", "greedy", "seeded")


def static_row(s: SampleSpec | None) -> bool:
    """Whether the static step samples this row as sampler.sample would (no logit processor, one choice)."""
    return s is not None and all(f.name in _READ or getattr(s, f.name) == f.default for f in fields(s))


@functools.cache
def _errors() -> tuple[str, str]:
    """The eager sampler's own words for a row whose logits hold NaN and for a row with no token left."""
    nan = sample(torch.full((1, 2), float("nan")), [SampleSpec(temperature=0.0)]).error(0)
    empty = sample(torch.full((1, 2), float("-inf")), [SampleSpec(seed=0)]).error(0)
    return nan, empty


class Columns:
    """Where each output lies in a row of the step's float64 result."""

    token = 0
    status = 1  # 0: sampled; 1: NaN logits; 2: nothing left to sample
    logprob = 2
    top_values = 3  # TOP_LOGPROBS columns
    top_ids = 3 + TOP_LOGPROBS


def fill_rows(ints: np.ndarray, floats: np.ndarray, specs: list[SampleSpec], vocab: int, reciprocal: bool) -> None:
    """Write the rows' sampling inputs (host side) into ints [INT_FIELDS, rows] and floats [FLOAT_FIELDS, rows],
    one row per spec. `reciprocal`: the temperature column holds float32(1 / float32(t)), which the step
    multiplies by, as CUDA's division by a host scalar does (it multiplies by the reciprocal); else t, which
    it divides by, as the CPU's does. A greedy row's temperature is 1 (never used)."""
    n = len(specs)
    greedy = [s.temperature < GREEDY_BELOW for s in specs]
    temps = [1.0 if g else s.temperature for s, g in zip(specs, greedy)]
    ints[0, :n] = [s.top_k if 0 < s.top_k < vocab else vocab for s in specs]
    ints[1, :n] = greedy
    ints[2, :n] = [s.seed is not None for s in specs]
    floats[0, :n] = (np.float32(1.0) / np.array(temps, np.float32)) if reciprocal else temps
    floats[1, :n] = [s.top_p for s in specs]
    floats[2, :n] = [s.min_p for s in specs]
    floats[3, :n] = [seeded_uniform(s.seed, s.step, s.choice) if s.seed is not None else 0.0 for s in specs]


def fill_padding(ints: np.ndarray, floats: np.ndarray, vocab: int) -> None:
    """Padding rows (ints [INT_FIELDS, k], floats [FLOAT_FIELDS, k]): greedy, their tokens dropped."""
    ints[:] = np.array([vocab, 1, 0])[:, None]
    floats[:] = np.array([1.0, 1.0, 0.0, 0.0])[:, None]


def sample_static(logits: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, sampling: bool, logprobs: bool,
                  reciprocal: bool) -> torch.Tensor:
    """logits [b, vocab]; ints [len(INT_FIELDS), b] int64, floats [len(FLOAT_FIELDS), b] float64 (fill_row)
    -> [b, 3 + 2 * TOP_LOGPROBS] float64 (Columns). `sampling`: some row is not greedy (else only the
    argmax runs); `logprobs`: some row asked for logprobs (else those columns are 0)."""
    logits = logits.float()
    b, vocab = logits.shape
    broken = torch.isnan(logits).any(dim=-1)
    token = logits.argmax(dim=-1)
    empty = torch.zeros_like(broken)
    if sampling:
        drawn, empty = _draw(logits, ints, floats, reciprocal)
        greedy = ints[1].bool()
        token = torch.where(greedy, token, drawn)
        empty = empty & ~greedy
    status = torch.where(broken, 1, torch.where(empty, 2, 0))
    out = torch.zeros(b, 3 + 2 * TOP_LOGPROBS, dtype=torch.float64, device=logits.device)
    out[:, Columns.token] = token.double()
    out[:, Columns.status] = status.double()
    if logprobs:
        raw = torch.log_softmax(logits, dim=-1)
        out[:, Columns.logprob] = raw.gather(1, token.unsqueeze(1)).squeeze(1).double()
        values, ids = raw.topk(min(TOP_LOGPROBS, vocab), dim=-1)
        out[:, Columns.top_values:Columns.top_values + values.shape[1]] = values.double()
        out[:, Columns.top_ids:Columns.top_ids + ids.shape[1]] = ids.double()
    return out


def _draw(logits: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor,
          reciprocal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """sampler._sample_row for unpenalized rows: (drawn token, nothing-left flag) per row."""
    b, vocab = logits.shape
    temperature = floats[0].float().unsqueeze(1)
    row = logits * temperature if reciprocal else logits / temperature
    row = _finite(row)
    # top-k: mask what is below the k-th largest value (k = vocab masks nothing)
    kth = row.sort(dim=-1, descending=True).values.gather(1, (ints[0] - 1).unsqueeze(1))
    row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    # min-p (0 masks nothing: probs < 0 never holds)
    row = row.masked_fill(probs < floats[2].float().unsqueeze(1) * probs.amax(dim=-1, keepdim=True),
                          float("-inf"))
    probs = torch.softmax(row, dim=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p, the likeliest token always; 1 cuts nothing
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    top_p = floats[1].float().unsqueeze(1)
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p) & (top_p < 1.0)
    drop[:, 0] = False
    cut = torch.zeros_like(drop).scatter_(1, order, drop)
    row = row.masked_fill(cut, float("-inf"))
    empty = torch.isneginf(row).all(dim=-1)
    probs = torch.softmax(row, dim=-1)
    # seeded: the inverse CDF at the row's uniform; the last token with mass where u * total rounds up
    cdf = probs.double().cumsum(dim=-1)
    at = floats[3].unsqueeze(1) * cdf[:, -1:]
    seeded = torch.searchsorted(cdf, at, right=True).squeeze(1)
    positions = torch.arange(vocab, device=logits.device).expand(b, vocab)
    last = torch.where(probs > 0, positions, 0).amax(dim=-1)
    seeded = torch.where(seeded == vocab, last, seeded)
    # unseeded: an exponential race (probs / Exp(1) is largest for a token with probability probs)
    raced = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
    return torch.where(ints[2].bool(), seeded, raced), empty


def _finite(row: torch.Tensor) -> torch.Tensor:
    """sampler._finite per row: NaN never drawn, +inf tokens share all the mass; finite rows unchanged."""
    row = row.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    pos = torch.isposinf(row)
    return torch.where(pos.any(dim=-1, keepdim=True), torch.where(pos, 0.0, float("-inf")), row)


def read_result(out: list[list[float]], specs: list[SampleSpec]) -> SampleResult:
    """The step's rows read back (out: its first len(specs) rows, as lists) -> what sampler.sample returns."""
    tokens, lps, tops, errors = [], [], [], []
    for row, s in zip(out, specs):
        status = int(row[Columns.status])
        error = _errors()[status - 1] if status else None
        tokens.append(-1 if error else int(row[Columns.token]))
        errors.append(error)
        if s.logprobs is None or error:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(row[Columns.logprob])
        k = s.logprobs
        tops.append([(int(i), v) for i, v in zip(row[Columns.top_ids:Columns.top_ids + k],
                                                  row[Columns.top_values:Columns.top_values + k])])
    return SampleResult(tokens, lps, tops, errors if any(errors) else None)
