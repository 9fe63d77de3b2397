"""A prefill budget that keeps decoding requests within a time-per-output-token SLO.

Chunked prefill caps a step at max_num_tokens whatever is decoding beside it, so one long prompt
stalls every running request for the length of its chunk. With `tpot_slo_ms` set, a step that carries
decoding requests takes only as many prefill tokens as the slowest of them can afford (Sarathi-Serve's
stall-free batching, with the budget in time instead of tokens):

    a request's TPOT at its end  = (elapsed + this step + after x decode step) / (generated + after)
    allowed step time            = min over decoding requests of
                                   tpot x (generated + after) - elapsed - after x decode step

(elapsed: since its first token; generated: its tokens so far, so the intervals once this step's token
is out; after: the tokens max_tokens allows past this step's; decode step: one that only decodes this
batch). TPOT is a mean over the request, so a prefill chunk's time is spread over every
token the request has yet to produce: a young request lends the slack of its whole future, and one
near its end, or behind, leaves the next chunk no more than the floor. A request that stops early (EOS,
a stop string) ends above the budget by what it had lent.

What a step of P prefill tokens and B decode rows costs is learnt from the engine's own steps as they run
(least squares, `StepTimeModel`); until it has seen enough of both kinds the budget is max_num_tokens.

The floor (`min_tokens`, one KV block) keeps a prompt moving when no decoding request has slack left.
Nothing is decoding: the whole max_num_tokens, since no request's TPOT is at stake.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

MARGIN = 0.9  # aim under the SLO: the model's error, and the serving time each token adds after the step
WINDOW = 256  # steps the model is fitted on (the newest)
REFIT_EVERY = 16


class StepTimeModel:
    """seconds = c0 + c1 x rows + c2 x attention, fitted on the steps seen.

    rows: the step's tokens (prefill tokens + one per decoding request); attention: the token pairs
    its attention reads, in millions (a prefill chunk of n tokens at offset o: n x (o + n / 2); a
    decoding request: its context length)."""

    def __init__(self) -> None:
        self._x: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)
        self._y: deque[float] = deque(maxlen=WINDOW)
        self._prefill_steps = 0
        self._decode_steps = 0
        self._since_fit = 0
        self.coef: np.ndarray | None = None

    def observe(self, rows: int, attention: float, prefill: bool, seconds: float) -> None:
        self._x.append((1.0, float(rows), attention))
        self._y.append(seconds)
        self._prefill_steps += prefill
        self._decode_steps += not prefill
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY and self._prefill_steps >= 4 and self._decode_steps >= 4:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        x, y = np.array(self._x), np.array(self._y)
        keep = [0, 1, 2]
        while True:  # a negative cost is noise, not a discount: drop that term and fit again
            coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            if (coef >= 0).all() or len(keep) == 1:
                break
            del keep[int(np.argmin(coef))]
        full = np.zeros(3)
        full[keep] = np.maximum(coef, 0.0)
        self.coef = full

    def seconds(self, rows: int, attention: float) -> float:
        c = self.coef
        return float(c[0] + c[1] * rows + c[2] * attention)


def attention_work(chunks: Iterable[tuple[int, int]], context_lens: Iterable[int]) -> float:
    """StepTimeModel's attention feature: chunks as (tokens, offset), decode rows as context lengths."""
    pairs = sum(n * (o + n / 2) for n, o in chunks) + sum(context_lens)
    return pairs / 1e6


# (tokens generated, tokens max_tokens allows after this step's, time of the first one, context length)
Decoding = tuple[int, int, float, int]


def prefill_allowance(tpot_s: float, max_tokens: int, min_tokens: int, decoding: list[Decoding], now: float,
                      step_seconds: Callable[[int, list[int]], float]) -> int:
    """The policy, on any step cost: `step_seconds(n, contexts)` is a step of n prefill tokens beside the
    decode rows of `contexts` (the engine's learnt model; the planner's profile)."""
    if not decoding:
        return max_tokens
    contexts = [c for *_, c in decoding]
    step = step_seconds(0, contexts)  # a step that only decodes
    # The request's TPOT at its end, if every later step only decodes: (elapsed + this step + after x
    # step) / (generated + after). Capping it at the SLO bounds this step.
    allowed = min(tpot_s * (generated + after) - (now - first) - after * step
                  for generated, after, first, _ in decoding)
    if step_seconds(max_tokens, contexts) <= allowed:
        return max_tokens
    lo, hi = 0, max_tokens  # lo fits (or is 0), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if step_seconds(mid, contexts) <= allowed:
            lo = mid
        else:
            hi = mid
    return max(lo, min(min_tokens, max_tokens))


class TpotBudget:
    """The engine's budget: the policy on the step costs it learns."""

    def __init__(self, tpot_slo_ms: float, max_tokens: int, min_tokens: int):
        self.tpot_s = tpot_slo_ms / 1000 * MARGIN
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.model = StepTimeModel()
        self.capped_steps = 0  # steps that got less than max_num_tokens of prefill

    def prefill_tokens(self, decoding: list[Decoding], offset: int, now: float) -> int:
        """`decoding`: each request this step decodes; offset: where the next prefill chunk starts in its
        prompt."""
        if self.model.coef is None:
            return self.max_tokens
        model = self.model

        def step_seconds(n: int, contexts: list[int]) -> float:
            return model.seconds(len(contexts) + n, attention_work([(n, offset)] if n else [], contexts))

        n = prefill_allowance(self.tpot_s, self.max_tokens, self.min_tokens, decoding, now, step_seconds)
        self.capped_steps += n < self.max_tokens
        return n


def sliver_waits(rest: int, max_num_tokens: int, step_prefills: bool) -> bool:
    """Should a new prompt wait rather than take a chunk that leaves it `rest` tokens? Yes when `rest` is
    under an eighth of the budget and the step already prefills another prompt: the prompt then heads
    the next step whole.

    Its first token comes from the next step either way, but the chunk would lengthen this one, and with
    it the first token of every prompt that finishes here. It happens whenever prompts sum to about the
    budget: two 256-token prompts in a 512-token step beside one decode row got 256 and 255 tokens, and
    the second waited a whole further step for its last token. A step that prefills no other prompt
    takes the chunk, so every prompt gets under way. The planner's simulator (plan/simulate.py) applies
    the same rule."""
    return step_prefills and rest < max_num_tokens // 8
