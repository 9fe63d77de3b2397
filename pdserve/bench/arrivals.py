"""When each request is released: a seeded Poisson (gamma) process, or all at once.

vLLM's `bench serve` draws inter-arrival gaps from a gamma distribution with shape = burstiness and
mean 1/rate; burstiness 1 is a Poisson process (exponential gaps). The first request leaves at
t = 0 and request i at the sum of the first i gaps, so n requests span about (n - 1) / rate
seconds. rate = inf releases everything at t = 0, which with --max-concurrency C is a closed loop
of C clients.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num_requests: int, request_rate: float, seed: int = 0, burstiness: float = 1.0) -> np.ndarray:
    """Release times in seconds since the start, shape [num_requests], nondecreasing, first = 0."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0 req/s (or inf for all at once), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive finite number (1 = Poisson), got {burstiness}")
    if num_requests == 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def parse_rate(text: str) -> float:
    """`"0.1"` -> 0.1, `"inf"` -> inf; anything else non-positive is an error naming the flag."""
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"--request-rate {text!r} is not a number; give req/s like 0.1, or inf") from None
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {text}")
    return rate
