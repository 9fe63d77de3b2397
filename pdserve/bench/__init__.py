"""Serving benchmark: a load generator for any OpenAI-compatible /v1/completions endpoint.

    workload.py    prompts and lengths
    arrivals.py    when each request is released
    runner.py      asyncio + httpx streaming
    metrics.py     TTFT/TPOT/ITL/E2E, goodput (vLLM's definitions)
    report.py      result JSON and table
    single_run.py  one run at one rate, from the flags cli.py and sweep.py share
    cli.py         `pdserve bench`
    sweep.py       rates x endpoints, DistServe goodput
"""

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.metrics import SLO, RequestRecord, summarize

__all__ = ["SLO", "RequestRecord", "arrival_offsets", "summarize"]
