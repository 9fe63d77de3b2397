"""One benchmark run at one rate, as `pdserve bench` does it and the sweep does at each rate: the
workload flags both share, and the endpoint, tokenizer, workload and result they describe.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.metrics import SLO, summarize
from pdserve.bench.report import build_result, rate_json
from pdserve.bench.runner import EndpointConfig, RunResult, run_requests
from pdserve.bench.workload import WorkloadRequest, build_workload, warmup_request
from pdserve.tokenizer import Tokenizer


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by `pdserve bench` and the sweep: endpoint, workload, SLOs, bounds."""
    p.add_argument("--model", required=True, help="model name the endpoint serves (GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--tokenizer", default=None,
                   help="HF directory or .gguf whose tokenizer builds the prompts (default: embedded SmolLM2)")
    p.add_argument("--prompt-kind", choices=["ids", "text"], default="ids",
                   help="ids: token-id prompts, exact length (default); text: random words calibrated to the length")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps; 1 = Poisson")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]; 0 = fixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:10000 tpot:150 (keys: ttft, tpot, e2el)")
    p.add_argument("--max-duration", type=float, default=3600.0,
                   help="stop the run after this many seconds; unfinished requests count as failed")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-fixed-output", action="store_true",
                   help="do not send ignore_eos/min_tokens (for servers that reject them); output may end early")
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into every request body")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed check request")
    p.add_argument("--disable-tqdm", action="store_true")


def endpoint_of(args: argparse.Namespace, base_url: str, engine_metrics: list[str] | None = None) -> EndpointConfig:
    if not isinstance(args.extra_body, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    for url in engine_metrics or []:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--engine-metrics takes server roots like http://127.0.0.1:8001, got {url!r}")
    return EndpointConfig(base_url=base_url, model=args.model, api_key=args.api_key,
                          fixed_output=not args.no_fixed_output, extra_body=args.extra_body,
                          request_timeout_s=args.request_timeout, engine_metrics=tuple(engine_metrics or ()))


def load_tokenizer(spec: str | None) -> Tokenizer:
    from pdserve.weights import resolve_model

    return Tokenizer.from_dir(resolve_model(spec))


def workload_of(args: argparse.Namespace, tokenizer: Tokenizer, seed: int | None = None) -> list[WorkloadRequest]:
    return build_workload(tokenizer, args.num_prompts, args.input_len, args.output_len,
                          args.random_range_ratio, args.seed if seed is None else seed, args.prompt_kind)


def run_config(args: argparse.Namespace, rate: float, slo: SLO | None) -> dict[str, Any]:
    return {
        "num_prompts": args.num_prompts, "request_rate": rate_json(rate), "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
        "random_range_ratio": args.random_range_ratio, "prompt_kind": args.prompt_kind, "seed": args.seed,
        "max_duration_s": args.max_duration, "goodput": slo.to_dict() if slo else None,
    }


def run_once(args: argparse.Namespace, ep: EndpointConfig, requests: list[WorkloadRequest], rate: float,
             slo: SLO | None, tokenizer: Tokenizer) -> dict[str, Any]:
    """One run at one rate -> the result document (see report.py)."""
    offsets = arrival_offsets(len(requests), rate, args.seed, args.burstiness)
    warmup = None if args.no_warmup else warmup_request(tokenizer, args.seed, args.prompt_kind)
    run: RunResult = asyncio.run(run_requests(ep, requests, offsets, args.max_concurrency, args.max_duration,
                                              warmup, progress=not args.disable_tqdm))
    summary = summarize(run.records, run.duration_s, slo)
    return build_result(summary, run.records, base_url=ep.base_url, model=ep.model, endpoint=ep.endpoint,
                        config=run_config(args, rate, slo), stopped_early=run.stopped_early,
                        engine_steps=run.engine_steps)
