"""Turn last-position logits into tokens: penalties and biases, temperature, top-k/top-p/min-p, seeded
draws. The logit adjustments apply in this order: repetition penalty, presence and frequency penalties,
logit bias, the tokens min_tokens bans, then a structured output's mask (engine/guided.py: every token its
grammar does not allow next is excluded; applied first, to the whole batch at once, which gives the same tokens:
see _mask_batch), all before temperature, top-k, top-p and min-p; logprobs are those of the model's own logits,
before any of them.

Each row is sampled on its own: legal but degenerate values (a temperature of 1e-300, a top_p that
rounds to 0 in float32, a repetition penalty whose division overflows) are handled numerically, and a
row that still cannot be sampled (the model's logits hold a NaN, every token is excluded) fails that
request alone, through `SampleResult.errors`, never the batch."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np
import torch

from pdserve.engine.sampling_params import GREEDY_BELOW

_U64 = (1 << 64) - 1  # an int64 seed's two's-complement bits: -1 and 2**63 - 1 stay apart
_DRAW_KEY = b"pdserve seeded draw v1"
_NOTHING_LEFT = ("no token is left to sample: every token was excluded by the request's penalties, biases, filters "
                 "or its structured output's grammar")


@dataclass(frozen=True)
class SampleSpec:
    """What the sampling rank needs to know about one sequence; it travels inside the step spec."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    step: int = 0  # tokens generated so far; with `seed` it makes each draw reproducible
    logprobs: int | None = None
    history: list[int] | None = None  # prompt + output ids, only sent when repetition_penalty != 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    output: list[int] | None = None  # output ids so far, only sent with a presence or frequency penalty
    logit_bias: list[tuple[int, float]] | None = None  # (token id, added to its logit)
    banned: list[int] | None = None  # tokens that may not be sampled this step (min_tokens not yet reached)
    allowed: bytes | None = None  # structured outputs: the grammar's mask, bit t % 32 of int32 word t // 32
    choice: int = 0  # which of a request's `n` choices this row is: each draws from a stream of its own
    choices: int = 1  # rows to sample from these logits, choices choice..choice+choices-1 (a prompt's first
    # token for every choice of a request with n > 1: the prompt is computed once, then forked)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    errors: list[str | None] | None = None  # per row: why it could not be sampled (its token is then -1)

    def error(self, i: int) -> str | None:
        return self.errors[i] if self.errors else None


def sample(logits: torch.Tensor, specs: list[SampleSpec]) -> SampleResult:
    """logits: [n, vocab] float32, one row per sampling sequence. The result has a row per choice: one
    per spec, and `choices` in order for a spec that forks."""
    logits = logits.float()
    if any(s.choices != 1 for s in specs):
        rows = [i for i, s in enumerate(specs) for _ in range(s.choices)]
        specs = [replace(s, choice=s.choice + c, choices=1) for s in specs for c in range(s.choices)]
        logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
    # A NaN logit makes argmax and softmax meaningless: such a row fails rather than emit a made-up token.
    broken = torch.isnan(logits).any(dim=-1).tolist()
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(s.logprobs is not None for s in specs) else None
    nothing_left = None
    if any(s.allowed is not None for s in specs):  # structured outputs
        logits = logits.clone()  # (the caller's tensor stays as it was)
        nothing_left = _mask_batch(logits, specs)
    penalized = [(s.repetition_penalty != 1.0 and bool(s.history)) or bool(s.output) or bool(s.logit_bias)
                 or bool(s.banned) for s in specs]
    # Greedy rows without a penalty or bias share one batched argmax (one op instead of one per sequence).
    plain_greedy = [s.temperature < GREEDY_BELOW and not p for s, p in zip(specs, penalized)]
    argmax = logits.argmax(dim=-1).tolist() if any(plain_greedy) else None
    tokens: list[int] = []
    errors: list[str | None] = [None] * len(specs)
    for i, s in enumerate(specs):
        if broken[i]:
            errors[i] = "the model's logits for this position contain NaN (a numeric overflow in the forward pass)"
            tokens.append(-1)
        elif nothing_left is not None and nothing_left[i]:
            errors[i] = f"sampling failed: {_NOTHING_LEFT}"
            tokens.append(-1)
        elif plain_greedy[i]:
            tokens.append(argmax[i])
        else:
            try:
                tokens.append(_sample_row(logits[i], s, penalized[i]))
            except (RuntimeError, ValueError) as e:  # this request's numbers, not the batch's
                errors[i] = f"sampling failed: {e}"
                tokens.append(-1)
    result = SampleResult(tokens, [None] * len(specs), [None] * len(specs), errors if any(errors) else None)
    if raw_logprobs is not None:
        for i, s in enumerate(specs):
            if s.logprobs is None or errors[i] is not None:
                continue
            result.logprobs[i] = float(raw_logprobs[i, tokens[i]])
            if s.logprobs > 0:
                vals, ids = raw_logprobs[i].topk(s.logprobs)
                result.top_logprobs[i] = list(zip(ids.tolist(), vals.tolist()))
            else:
                result.top_logprobs[i] = []
    return result


def _sample_row(row: torch.Tensor, s: SampleSpec, penalized: bool) -> int:
    if penalized:
        row = _finite(_adjust(row, s))
    if s.temperature < GREEDY_BELOW:  # dividing by a tinier temperature overflows; its limit is greedy
        return int(row.argmax())
    return _draw(_filter(_finite(row / s.temperature), s), s)


def _finite(row: torch.Tensor) -> torch.Tensor:
    """`row` without NaN or +inf, keeping what they mean: a NaN logit (inf * 0 in a penalty) is never
    drawn, and tokens pushed to +inf (a penalty's division overflowing) share all the mass."""
    if bool(torch.isfinite(row).all()):
        return row
    row = row.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    if bool(torch.isposinf(row).any()):
        row = torch.where(torch.isposinf(row), 0.0, float("-inf"))
    return row


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


def _mask_batch(logits: torch.Tensor, specs: list[SampleSpec]) -> list[bool]:
    """Set, in place, every token a guided row's grammar does not allow next to -inf, the whole batch in a few
    ops; per row, whether no token is left. The masks come first here, though the documented order puts them
    after the adjustments: a token at -inf stays there under each of them (a bias adds, a penalty scales or
    subtracts a finite amount, min_tokens bans), so the tokens drawn are the same, and a greedy guided row with
    no other processor keeps the batched argmax. logits: [n, vocab]."""
    rows = [i for i, s in enumerate(specs) if s.allowed is not None]
    vocab = logits.shape[-1]
    allowed = np.zeros((len(rows), vocab), dtype=bool)  # tokens past a mask's end are never allowed
    for r, i in enumerate(rows):
        bits = np.unpackbits(np.frombuffer(specs[i].allowed, dtype=np.uint8), bitorder="little")[:vocab]
        allowed[r, :bits.size] = bits
    allowed = torch.from_numpy(allowed).to(logits.device)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    left = allowed.any(dim=-1).tolist()
    out = [False] * len(specs)
    for r, i in enumerate(rows):
        out[i] = not left[r]
    return out


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
        drop[0] = False  # the likeliest token stays, however small top_p (1e-300 is 0.0 in float32)
        row = row.clone()
        row[order[drop]] = float("-inf")
    return row


def _draw(row: torch.Tensor, s: SampleSpec) -> int:
    if bool(torch.isneginf(row).all()):
        raise ValueError(_NOTHING_LEFT)
    probs = torch.softmax(row, dim=-1)
    if s.seed is None:
        return int(torch.multinomial(probs, 1))
    return _inverse_cdf(probs, seeded_uniform(s.seed, s.step, s.choice))


def seeded_uniform(seed: int, step: int, choice: int = 0) -> float:
    """Draw number `step` of `seed`'s stream for a request's choice `choice`, in [0, 1) with 53 random bits.

    A counter-based generator (as Philox is): a keyed hash of all 64 bits of the int64 seed and of the
    output position. A draw depends on (seed, step) alone, not on the batch, the rank or the draws
    before it, so a stream resumed at position N goes on as it would have; and seeds that differ only
    above bit 32 (torch's CPU generator keeps 32 bits of its seed) or in the sign get streams of their own.
    Each choice of an n > 1 request has its stream too (choice 0's is the n = 1 stream, so choice 0 of a
    seeded request is what the same request with n = 1 gives).
    """
    msg = (seed & _U64).to_bytes(8, "little") + step.to_bytes(8, "little")
    if choice:
        msg += choice.to_bytes(8, "little")
    bits = int.from_bytes(hashlib.blake2b(msg, digest_size=8, key=_DRAW_KEY).digest(), "little")
    return (bits >> 11) * 2.0 ** -53


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token whose slice of the cumulative distribution holds `u` of the total mass. probs: [vocab].
    A token with no mass has an empty slice, so it is never drawn."""
    cdf = probs.double().cumsum(0)
    at = torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    i = int(torch.searchsorted(cdf, at, right=True))
    if i == probs.numel():  # u * total rounded up to the total: the last token with mass
        i = int(probs.nonzero()[-1])
    return i
