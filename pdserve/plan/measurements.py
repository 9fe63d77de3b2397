"""What a profile holds (profile.py measures it): forward-step timings per thread count, KV write timings
per backend, and the serving probe's figures; and its JSON form (schema pdserve.plan.profile/1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROFILE_SCHEMA = "pdserve.plan.profile/1"


@dataclass
class StepTimings:
    """Forward-step seconds at one thread count (medians of a few repetitions)."""

    threads: int
    prefill: dict[int, float]  # prompt tokens -> s
    chunk: tuple[int, int, float]  # (tokens, offset, s)
    decode: dict[tuple[int, int], float]  # (batch, context tokens) -> s

    def to_dict(self) -> dict[str, Any]:
        return {"threads": self.threads, "prefill": [[n, s] for n, s in sorted(self.prefill.items())],
                "chunk": list(self.chunk), "decode": [[b, c, s] for (b, c), s in sorted(self.decode.items())]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepTimings:
        return cls(int(d["threads"]), {int(n): float(s) for n, s in d["prefill"]},
                   (int(d["chunk"][0]), int(d["chunk"][1]), float(d["chunk"][2])),
                   {(int(b), int(c)): float(s) for b, c, s in d["decode"]})


@dataclass
class Profile:
    key: dict[str, Any]  # what the costs depend on (see profile_key)
    model: dict[str, Any]  # layers, kv heads, head_dim, element bytes, kv bytes per token, max_model_len
    steps: dict[int, StepTimings]  # threads (CPU) or GPUs (CUDA) -> timings
    transfer: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # backend -> [(bytes, s)]
    # Serving beyond the forward steps, from real servers (see measure_serving): per deployment kind
    # ("aggregated", "disaggregated": one-thread instances; "aggregated@T": one T-thread instance),
    # {"ttft_s": extra s per request before its first token, "itl_s": extra s per decode step,
    #  "itl_row_s": extra s per decode row of a step, "prefill_factor": server prefill / bare prefill}
    serving: dict[str, dict[str, float]] = field(default_factory=dict)
    date: str = ""
    seconds: float = 0.0  # how long profiling took

    @property
    def kv_bytes_per_token(self) -> int:
        return int(self.model["kv_bytes_per_token"])

    @property
    def state_bytes_per_request(self) -> int:
        """A hybrid model's recurrent state, moved once per request whatever its length (0 for others and for
        profiles measured before hybrid models)."""
        return int(self.model.get("state_bytes_per_request", 0))

    @property
    def units(self) -> list[int]:
        return sorted(self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": PROFILE_SCHEMA, "date": self.date, "seconds": round(self.seconds, 1), "key": self.key,
                "model": self.model, "steps": [t.to_dict() for _, t in sorted(self.steps.items())],
                "transfer": {b: [[n, s] for n, s in pts] for b, pts in self.transfer.items()},
                "serving": self.serving}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("schema") != PROFILE_SCHEMA:
            raise ValueError(f"not a {PROFILE_SCHEMA} document (schema {d.get('schema')!r})")
        steps = {t.threads: t for t in map(StepTimings.from_dict, d["steps"])}
        transfer = {b: [(int(n), float(s)) for n, s in pts] for b, pts in d.get("transfer", {}).items()}
        return cls(d["key"], d["model"], steps, transfer, d.get("serving", {}), d.get("date", ""),
                   float(d.get("seconds", 0.0)))
