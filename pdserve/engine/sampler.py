"""Turn last-position logits into tokens: penalties and biases, temperature, top-k/top-p/min-p, seeded
draws. The logit adjustments apply in this order: repetition penalty, presence and frequency penalties,
logit bias, then the tokens min_tokens bans; logprobs are those of the model's own logits, before any
of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SampleSpec:
    """What the sampling rank needs to know about one sequence (sent over the wire as a dict)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int | None
    step: int  # tokens generated so far; with `seed` it makes each draw reproducible
    logprobs: int | None
    history: list[int] | None  # prompt + output ids, only sent when repetition_penalty != 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    output: list[int] | None = None  # output ids so far, only sent with a presence or frequency penalty
    logit_bias: list[tuple[int, float]] | None = None  # (token id, added to its logit)
    banned: list[int] | None = None  # tokens that may not be sampled this step (min_tokens not yet reached)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def sample(logits: torch.Tensor, specs: list[SampleSpec]) -> SampleResult:
    """logits: [n, vocab] float32, one row per sampling sequence."""
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(s.logprobs is not None for s in specs) else None
    penalized = [(s.repetition_penalty != 1.0 and bool(s.history)) or bool(s.output) or bool(s.logit_bias)
                 or bool(s.banned) for s in specs]
    # Greedy rows without a penalty or bias share one batched argmax (one op instead of one per sequence).
    plain_greedy = [s.temperature == 0.0 and not p for s, p in zip(specs, penalized)]
    argmax = logits.argmax(dim=-1).tolist() if any(plain_greedy) else None
    tokens: list[int] = []
    for i, s in enumerate(specs):
        if plain_greedy[i]:
            tokens.append(argmax[i])
            continue
        row = _adjust(logits[i], s) if penalized[i] else logits[i]
        if s.temperature == 0.0:
            tokens.append(int(row.argmax()))
            continue
        tokens.append(_draw(_filter(row / s.temperature, s), s))
    result = SampleResult(tokens, [None] * len(specs), [None] * len(specs))
    if raw_logprobs is not None:
        for i, s in enumerate(specs):
            if s.logprobs is None:
                continue
            result.logprobs[i] = float(raw_logprobs[i, tokens[i]])
            if s.logprobs > 0:
                vals, ids = raw_logprobs[i].topk(s.logprobs)
                result.top_logprobs[i] = list(zip(ids.tolist(), vals.tolist()))
            else:
                result.top_logprobs[i] = []
    return result


def _adjust(row: torch.Tensor, s: SampleSpec) -> torch.Tensor:
    """A copy of `row` with the sequence's penalties, logit bias and banned tokens applied."""
    row = row.clone()
    if s.repetition_penalty != 1.0 and s.history:
        seen = torch.tensor(sorted(set(s.history)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty)
    if s.output:
        ids, counts = torch.tensor(s.output, dtype=torch.long, device=row.device).unique(return_counts=True)
        row[ids] -= s.presence_penalty + s.frequency_penalty * counts.to(row.dtype)
    if s.logit_bias:
        ids = torch.tensor([t for t, _ in s.logit_bias], dtype=torch.long, device=row.device)
        row[ids] += torch.tensor([b for _, b in s.logit_bias], dtype=row.dtype, device=row.device)
    if s.banned:
        row[torch.tensor(s.banned, dtype=torch.long, device=row.device)] = float("-inf")
    return row


def _filter(row: torch.Tensor, s: SampleSpec) -> torch.Tensor:
    if s.top_k > 0 and s.top_k < row.numel():
        kth = row.topk(s.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if s.min_p > 0.0:
        row = row.masked_fill(probs < s.min_p * probs.max(), float("-inf"))
        probs = torch.softmax(row, dim=-1)
    if s.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop = sorted_probs.cumsum(0) - sorted_probs >= s.top_p
        row = row.clone()
        row[order[drop]] = float("-inf")
    return row


def _draw(row: torch.Tensor, s: SampleSpec) -> int:
    probs = torch.softmax(row, dim=-1)
    gen = None
    if s.seed is not None:
        gen = torch.Generator(device=row.device)
        gen.manual_seed((s.seed * 1_000_003 + s.step) & 0x7FFF_FFFF_FFFF_FFFF)
    return int(torch.multinomial(probs, 1, generator=gen))
