"""The result of one run: a JSON document and the table printed at the end of `pdserve bench`.

JSON (schema "pdserve.bench.run/1"): the flat summary of metrics.summarize (vLLM's key names:
duration, completed, failed, total_input_tokens, total_output_tokens, request_throughput,
request_goodput, slo_attainment, good_requests, output_throughput, total_token_throughput and
{mean,median,std,p50,p90,p99}_{ttft,tpot,itl,e2el}_ms), plus

    schema, date, base_url, model, endpoint, request_rate (number or "inf"), max_concurrency,
    config: {num_prompts, request_rate, burstiness, max_concurrency, input_len, output_len,
             random_range_ratio, prompt_kind, seed, max_duration_s, goodput: {ttft_ms, tpot_ms}},
    stopped_early: bool,
    engine_steps: {busy_fraction, instances, kinds: {prefill|decode|mixed: {steps, seconds}},
                   tokens: {prefill, decode}}
                  | null   (a pdserve server's engine during the run: bench/server_steps.py; null for
                  other servers and the orchestrator)
    requests: [{index, prompt_len, expected_output_len, arrival_time, send_time, success, error,
                ttft, itl: [s, ...], e2e, output_tokens}]   (seconds since the run started)
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import RequestRecord

SCHEMA = "pdserve.bench.run/1"
_WIDTH = 50
_SECTIONS = (("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
             ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL"))


def build_result(summary: dict[str, Any], records: list[RequestRecord], *, base_url: str, model: str,
                 endpoint: str, config: dict[str, Any], stopped_early: bool,
                 engine_steps: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": base_url, "model": model, "endpoint": endpoint,
        "config": config,
        # vLLM's result files name the offered rate this way; the sweep and the plots read it.
        "request_rate": config["request_rate"],
        "max_concurrency": config["max_concurrency"],
        "stopped_early": stopped_early,
        "engine_steps": engine_steps,
        **summary,
        "requests": [r.to_dict() for r in records],
    }


def write_json(path: str | os.PathLike, doc: dict[str, Any]) -> None:
    """Write through a temporary sibling, so an interrupted run never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    # allow_nan=False: an unbounded rate must already be the string "inf" (see rate_json).
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False), encoding="utf-8")
    tmp.replace(path)


def rate_json(rate: float) -> float | str:
    """A request rate as vLLM's result files write it: a number, or "inf"."""
    return rate if math.isfinite(rate) else "inf"


def load_json(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value:>{_WIDTH - 41}}"


def format_table(result: dict[str, Any]) -> str:
    """vLLM's bench serve table, with p90 beside its p99."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=_WIDTH, c="="),
             _row("Successful requests:", result["completed"]),
             _row("Failed requests:", result["failed"]),
             _row("Request rate (req/s):", str(result["request_rate"])),
             _row("Max concurrency:", str(result["max_concurrency"])),
             _row("Benchmark duration (s):", result["duration"]),
             _row("Total input tokens:", result["total_input_tokens"]),
             _row("Total generated tokens:", result["total_output_tokens"]),
             _row("Request throughput (req/s):", result["request_throughput"])]
    if result.get("request_goodput") is not None:
        lines += [_row("Request goodput (req/s):", result["request_goodput"]),
                  _row("SLO attainment (%):", 100.0 * result["slo_attainment"])]
    lines += [_row("Output token throughput (tok/s):", result["output_throughput"]),
              _row("Total token throughput (tok/s):", result["total_token_throughput"])]
    for key, title, short in _SECTIONS:
        lines.append("{s:{c}^{n}}".format(s=title, n=_WIDTH, c="-"))
        for stat in ("mean", "median"):
            lines.append(_row(f"{stat.capitalize()} {short} (ms):", result[f"{stat}_{key}_ms"]))
        for name in sorted((k for k in result if k.startswith("p") and k.endswith(f"_{key}_ms")
                            and k != f"p50_{key}_ms"),
                           key=lambda k: float(k[1:].split("_")[0])):
            lines.append(_row(f"{name.split('_')[0].upper()} {short} (ms):", result[name]))
    steps = result.get("engine_steps")
    if steps:
        many = steps.get("instances", 1)
        title = f"Engine steps, {many} instances" if many > 1 else "Server engine steps"
        lines.append("{s:{c}^{n}}".format(s=title, n=_WIDTH, c="-"))
        if steps["busy_fraction"] is not None:
            label = "Engine busy (% of duration):" if many == 1 else "Engine busy, mean (% of duration):"
            lines.append(_row(label, 100.0 * steps["busy_fraction"]))
        for kind, k in steps["kinds"].items():
            mean_ms = 1000.0 * k["seconds"] / k["steps"]
            lines.append(_row(f"{kind.capitalize()} steps, mean ms ({k['steps']}):", mean_ms))
    lines.append("=" * _WIDTH)
    if result.get("stopped_early"):
        lines.append("stopped early: --max-duration ran out; unfinished requests count as failed")
    return "\n".join(lines)
