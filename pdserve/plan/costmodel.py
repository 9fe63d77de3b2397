"""Forward-step time of any batch, from a profile's measured shapes.

    prefill(n)          one sequence of n tokens from position 0: piecewise linear between the
                        measured lengths (GEMM efficiency changes with n), extended past the longest
                        with its last segment's slope
    chunk attention     alpha x tokens x offset: what a chunk pays for the tokens before it
    decode(B, K)        B sequences, K context tokens in all: base(B), piecewise linear in B, plus
                        beta x K (every sequence's KV is read once)
    mixed step          prefill(prefill tokens + B) + alpha x sum(chunk x offset) + beta x K: one
                        forward over every row, plus both attentions

KV transfer time is affine in bytes (fixed cost + bytes / bandwidth), least squares over the
measured writes.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from pdserve.plan.measurements import Profile, StepTimings


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (sorted xs), linear past both ends, never below 0."""
    if len(xs) == 1:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class StepCost:
    """Seconds of one forward step at one thread count."""

    def __init__(self, t: StepTimings):
        self.units = t.threads
        self._pre_n = sorted(t.prefill)
        self._pre_s = [t.prefill[n] for n in self._pre_n]
        chunk, offset, s = t.chunk
        self.alpha = max(0.0, (s - self.prefill(chunk)) / (chunk * offset)) if offset else 0.0
        contexts = sorted({c for _, c in t.decode})
        lo, hi = contexts[0], contexts[-1]
        slopes = [(t.decode[(b, hi)] - t.decode[(b, lo)]) / (b * (hi - lo))
                  for b, c in t.decode if c == lo and (b, hi) in t.decode and hi > lo]
        self.beta = max(0.0, sorted(slopes)[len(slopes) // 2]) if slopes else 0.0
        base = {}
        for (b, c), secs in t.decode.items():
            base.setdefault(b, []).append(secs - self.beta * b * c)
        self._dec_b = sorted(base)
        self._dec_s = [max(1e-6, sum(base[b]) / len(base[b])) for b in self._dec_b]

    def prefill(self, n: int) -> float:
        return _interp(self._pre_n, self._pre_s, n)

    def decode(self, batch: int, context_tokens: int) -> float:
        return _interp(self._dec_b, self._dec_s, batch) + self.beta * context_tokens

    def step(self, chunks: Sequence[tuple[int, int]], batch: int, context_tokens: int) -> float:
        """chunks: (tokens, offset) of each prefill chunk; batch, context_tokens: the decode rows."""
        if not chunks:
            return self.decode(batch, context_tokens) if batch else 0.0
        tokens = sum(c for c, _ in chunks)
        return self.prefill(tokens + batch) + self.alpha * sum(c * o for c, o in chunks) + self.beta * context_tokens


class TransferCost:
    """Seconds to move n bytes of KV with one backend: fixed + n / bandwidth."""

    def __init__(self, points: Sequence[tuple[int, float]]):
        if not points:
            raise ValueError("no transfer measurements")
        n = len(points)
        mx = sum(b for b, _ in points) / n
        my = sum(s for _, s in points) / n
        var = sum((b - mx) ** 2 for b, _ in points)
        slope = sum((b - mx) * (s - my) for b, s in points) / var if var else my / mx
        self.per_byte = max(slope, 1e-12)
        self.fixed = max(0.0, my - self.per_byte * mx)

    def seconds(self, nbytes: int) -> float:
        return self.fixed + self.per_byte * nbytes

    @property
    def gb_per_s(self) -> float:
        return 1e-9 / self.per_byte


def step_costs(profile: Profile) -> dict[int, StepCost]:
    return {n: StepCost(t) for n, t in profile.steps.items()}


def transfer_costs(profile: Profile) -> dict[str, TransferCost]:
    return {b: TransferCost(pts) for b, pts in profile.transfer.items() if pts}
