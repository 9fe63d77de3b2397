"""Predicted goodput of each candidate deployment at an SLO, and the ranking.

Goodput is DistServe's, as `pdserve bench sweep` measures it: the highest request rate at which at
least `target` of the requests meet both the TTFT and the TPOT SLO (and every lower rate does too).
Without a list of rates it is searched: rates double from a small fraction of the deployment's
prefill capacity until one misses, then bisection narrows the step to 5%. Every rate sees the same
unit-rate Poisson draws, scaled, so attainment falls with the rate as it should.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.plan.candidates import Candidate
from pdserve.plan.simulate import Deployment, Outcome, Workload, simulate


@dataclass(frozen=True)
class PlanSLO:
    ttft_ms: float
    tpot_ms: float

    @classmethod
    def parse(cls, text: str) -> PlanSLO:
        """'ttft:2500,tpot:100' (milliseconds)."""
        values: dict[str, float] = {}
        for item in text.replace(" ", ",").split(","):
            if not item:
                continue
            key, sep, value = item.partition(":")
            if not sep or key not in ("ttft", "tpot"):
                raise ValueError(f"--slo item {item!r} is not ttft:MS or tpot:MS; e.g. --slo ttft:2500,tpot:100")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--slo item {item!r}: {value!r} is not a number of milliseconds") from None
            if not 0 < ms < float("inf"):
                raise ValueError(f"--slo item {item!r}: the SLO must be a positive, finite number of milliseconds")
            if key in values:
                raise ValueError(f"--slo names {key} twice")
            values[key] = ms
        if set(values) != {"ttft", "tpot"}:
            raise ValueError("--slo needs both budgets, e.g. --slo ttft:2500,tpot:100")
        return cls(values["ttft"], values["tpot"])

    def __str__(self) -> str:
        return f"TTFT {self.ttft_ms:g} ms, TPOT {self.tpot_ms:g} ms"


@dataclass
class Prediction:
    candidate: Candidate
    goodput: float  # req/s
    points: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment) simulated
    at_rate: float = 0.0  # the rate `outcome` is for
    outcome: Outcome | None = None


def attainment(dep: Deployment, wl: Workload, rate: float, slo: PlanSLO) -> tuple[float, Outcome]:
    out = simulate(dep, wl, rate)
    return out.attainment(slo.ttft_ms / 1000, slo.tpot_ms / 1000), out


def search_goodput(dep: Deployment, wl: Workload, slo: PlanSLO, capacity: float, target: float = 0.9,
                   rates: Sequence[float] | None = None) -> tuple[float, list[tuple[float, float]]]:
    """(goodput, the (rate, attainment) points simulated). `capacity`: an upper bound of the rate."""
    points: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        att, _ = attainment(dep, wl, rate, slo)
        points.append((rate, att))
        return att >= target

    if rates:
        best = 0.0
        for r in sorted(rates):
            if not ok(r):
                break
            best = r
        return best, points
    lo = capacity / 64
    if not ok(lo):
        return 0.0, points
    hi = lo * 2
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > capacity * 4:
            return lo, points
    while hi / lo > 1.05:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo, points


def capacity(dep: Deployment, wl: Workload) -> float:
    """Requests per second the prefill side could take if it did nothing else: an upper bound."""
    side = dep.instances if dep.kind == "aggregated" else dep.context
    return sum(1.0 / max(inst.cost.prefill(wl.input_len), 1e-6) for inst in side)


def rank(predictions: list[Prediction]) -> list[Prediction]:
    """Highest goodput first; ties by lower TTFT p90 at the evaluated rate, then by fewer instances."""
    def key(p: Prediction):
        ttft = p.outcome.percentile("ttft", 90) if p.outcome is not None else float("inf")
        return (-round(p.goodput, 6), ttft, p.candidate.name)

    return sorted(predictions, key=key)
