"""Per-request timings and the benchmark summary, with vLLM `bench serve`'s definitions.

For one streamed request (times in seconds, measured on the client):

    send ──────── first chunk ── chunk ── chunk ── ... ── last chunk
         <- TTFT ->           <-ITL->  <-ITL->
         <------------------------- E2E ---------------------------->

    TPOT = (E2E - TTFT) / (output_tokens - 1)      only when output_tokens > 1

A "chunk" is an SSE event that carries a choice; each ITL is the gap between two consecutive
chunks, so a server that packs several tokens into one event shows one long gap (as in vLLM).
output_tokens comes from the server's usage when it sends one, else it is the number of chunks.

Summary (vLLM's names, so its result files and ours read alike): percentiles are numpy's linear
interpolation over successful requests; an empty set gives 0. Throughputs divide by the wall time
of the whole run. A request is "good" when it succeeded and meets every SLO given:
TTFT <= ttft, TPOT <= tpot (a request with one output token counts as TPOT 0), E2E <= e2el.
request_goodput = good / duration; slo_attainment = good / all requests (failed ones count as
missing the SLO), which is what DistServe's goodput is built from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What the client saw of one request; times are seconds since the benchmark started."""

    index: int
    prompt_len: int  # tokens in the prompt (the server's usage.prompt_tokens when it reports it)
    expected_output_len: int
    arrival_time: float = 0.0  # when the arrival process released it
    send_time: float = 0.0  # when it was sent (later than arrival_time under --max-concurrency)
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def token_times(self) -> np.ndarray:
        """Arrival time of every chunk, seconds since the benchmark started."""
        if not self.success:
            return np.zeros(0)
        first = self.send_time + self.ttft
        return first + np.concatenate([[0.0], np.cumsum(self.itl)])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; None means not part of goodput."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: Sequence[str] | None) -> SLO | None:
        """`["ttft:10000", "tpot:150"]` (vLLM's --goodput syntax) -> SLO; None or [] -> None."""
        if not items:
            return None
        values: dict[str, float] = {}
        for item in items:
            key, sep, value = item.partition(":")
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"--goodput item {item!r} is not KEY:MILLISECONDS with KEY one of "
                                 f"{', '.join(SLO_KEYS)}; e.g. --goodput ttft:10000 tpot:150")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--goodput item {item!r}: {value!r} is not a number of milliseconds") from None
            if not ms > 0:
                raise ValueError(f"--goodput item {item!r}: the SLO must be a positive number of milliseconds")
            if key in values:
                raise ValueError(f"--goodput names {key} twice; give each SLO once")
            values[key] = ms
        return cls(**{f"{k}_ms": v for k, v in values.items()})

    def is_met(self, r: RequestRecord) -> bool:
        if not r.success:
            return False
        tpot = r.tpot or 0.0
        checks = ((self.ttft_ms, r.ttft), (self.tpot_ms, tpot), (self.e2el_ms, r.e2e))
        return all(slo is None or value * 1000.0 <= slo for slo, value in checks)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pNN of `values_s` (seconds) as `<stat>_<name>_ms` keys."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = ms.size == 0
    out = {
        f"mean_{name}_ms": 0.0 if empty else float(ms.mean()),
        f"median_{name}_ms": 0.0 if empty else float(np.median(ms)),
        f"std_{name}_ms": 0.0 if empty else float(ms.std()),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))
    return out


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float | int]:
    """The flat result dict (vLLM key names) over all records of one run."""
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    good = sum(slo.is_met(r) for r in records) if slo is not None else 0
    out: dict[str, float | int] = {
        "duration": duration_s,
        "num_prompts": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if slo is not None else None,
        "slo_attainment": good / len(records) if slo is not None and records else None,
        "good_requests": good if slo is not None else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    out |= _stats("ttft", [r.ttft for r in ok], percentiles)
    out |= _stats("tpot", [t for r in ok if (t := r.tpot) is not None], percentiles)
    out |= _stats("itl", [x for r in ok for x in r.itl], percentiles)
    out |= _stats("e2el", [r.e2e for r in ok], percentiles)
    return out
