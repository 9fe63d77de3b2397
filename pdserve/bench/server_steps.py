"""What a pdserve server's engine did during a run: two scrapes of its /metrics, one after the warm-up
and one after the last request, differenced.

    engine_steps = {"busy_fraction": 0.64,            # step time / the run's duration
                    "kinds": {"prefill": {"steps": 18, "seconds": 5.65},
                              "decode": {"steps": 680, "seconds": 17.79},
                              "mixed": {"steps": 13, "seconds": 4.40}},
                    "tokens": {"prefill": 7696, "decode": 931}}

A served TPOT then splits into the engine's steps and the rest: a request that decodes through a
`mixed` step (a prompt's prefill beside the decoding requests) waits for the whole prompt chunk. Other
servers (vLLM, pdserve's orchestrator, which runs no engine) have no such metrics: None.

Behind pdserve's orchestrator, name its instances instead (`pdserve bench --engine-metrics URL ...`):
their counters are summed, and busy_fraction is the mean over them (`"instances": N` says how many).
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

STEP_SECONDS = "pdserve_engine_step_seconds"
STEP_TOKENS = "pdserve_engine_step_tokens"
_KEYS = {STEP_SECONDS + "_sum": "seconds", STEP_SECONDS + "_count": "steps", STEP_TOKENS + "_total": "tokens"}


async def scrape_all(client: httpx.AsyncClient, base_urls: list[str]) -> dict[str, float] | None:
    """The counters of several servers, summed; None unless every one of them publishes them."""
    total: dict[str, float] = {}
    for url in base_urls:
        values = await scrape(client, url)
        if values is None:
            return None
        for key, value in values.items():
            total[key] = total.get(key, 0.0) + value
    return total


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """{"seconds:KIND", "steps:KIND", "tokens:KIND": value} from base_url/metrics ({} before its first
    step); None when the server does not publish pdserve's step metrics (or /metrics does not answer)."""
    try:
        response = await client.get(base_url.rstrip("/") + "/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    values: dict[str, float] = {}
    try:
        families = [f for f in text_string_to_metric_families(response.text) if f.name in (STEP_SECONDS, STEP_TOKENS)]
    except ValueError:  # not Prometheus text
        return None
    for family in families:
        for sample in family.samples:
            kind, key = sample.labels.get("kind"), _KEYS.get(sample.name)
            if key and kind:
                values[f"{key}:{kind}"] = sample.value
    return values if families else None


def difference(before: dict[str, float] | None, after: dict[str, float] | None,
               duration_s: float, instances: int = 1) -> dict[str, Any] | None:
    """The run's share of the counters of `instances` servers (see the module docstring); None unless both
    scrapes worked."""
    if before is None or after is None:
        return None
    grew = {k: v - before.get(k, 0.0) for k, v in after.items()}
    kinds = {}
    for kind in ("prefill", "decode", "mixed"):
        steps = round(grew.get(f"steps:{kind}", 0.0))
        if steps:
            kinds[kind] = {"steps": steps, "seconds": round(grew.get(f"seconds:{kind}", 0.0), 4)}
    busy = sum(k["seconds"] for k in kinds.values())
    return {"busy_fraction": round(busy / (duration_s * instances), 4) if duration_s > 0 else None,
            "instances": instances, "kinds": kinds,
            "tokens": {kind: round(grew.get(f"tokens:{kind}", 0.0)) for kind in ("prefill", "decode")}}


def describe(steps: dict[str, Any] | None) -> str:
    """One line for a run's report: busy share, and each kind's count and mean."""
    if not steps:
        return ""
    busy = steps["busy_fraction"]
    parts = [f"engine busy {100 * busy:.0f}%" if busy is not None else "engine busy ?"]
    if steps.get("instances", 1) > 1:
        parts[0] += f" (mean of {steps['instances']} instances)"
    for kind, k in steps["kinds"].items():
        parts.append(f"{kind} {k['steps']} x {1000 * k['seconds'] / k['steps']:.0f} ms")
    return ", ".join(parts)
