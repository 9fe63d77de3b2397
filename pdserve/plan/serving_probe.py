"""What serving adds to the forward steps, measured on real servers of this machine.

A step of the engine is not all a client waits for: the HTTP request, tokenizing, the scheduler, the
streaming of every token and, disaggregated, the orchestrator's two hops and the KV exchange's control
messages all take time too, and on a small machine they take it from the same cores. The probe starts
`pdserve launch` with one context instance on core 0 and one generation instance on core 1 (one
thread each, KV over shm), and streams a few requests one at a time:

- aggregated: straight to the generation instance, which then prefills and decodes itself;
- disaggregated: through the orchestrator.

Then, for each larger instance size T the profile holds (2, 4, ... threads), it launches one T-thread
instance alone behind the orchestrator, as an aggregated pick is deployed, and probes that path too
("aggregated@T"). Such an instance's threads share every core with the HTTP server, the tokenizer and
the orchestrator, so the one-thread figures do not carry over to it.

Per kind, the median TTFT [less the KV transfer] at two prompt lengths gives TTFT(n) = ttft_s +
prefill_factor x prefill(n): a server's prefill can run slower than the profile's bare forward step,
and the median of (inter-token latency - the profile's decode step) is the extra time of
each decode step (itl_s).

A line through two medians of three requests cannot tell slower steps from a longer wait outside them,
and the two differ under load: only the steps queue the requests behind them. So the probe also reads
the prefilling engine's own step timer (its /metrics, as `pdserve bench` does): step_factor is the
served prefill step over the bare one, and step_ttft_s the rest of the TTFT. An aggregated candidate, and
a split's context instance, are simulated with these (docs/benchmarks.md, "The probe reads the engine's
step timer").

Then ROWS requests of a short prompt are sent at once and decode together: every token streamed costs
the server, the orchestrator and the client some CPU, and on a small machine that is taken from the
forward steps. The median of (inter-token latency - the profile's decode step of ROWS sequences) less
itl_s, over ROWS - 1, is the extra time of each decode row of a step (itl_row_s).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import tempfile
from pathlib import Path

import httpx
import numpy as np

from pdserve.bench.runner import EndpointConfig, run_requests
from pdserve.bench.workload import WorkloadRequest
from pdserve.host import free_port
from pdserve.plan.costmodel import StepCost, TransferCost

log = logging.getLogger(__name__)
OUTPUT_TOKENS = 16
REPEATS = 3  # per prompt length and path, after one warm-up request
ROWS = 8  # requests decoding together in the concurrent phase
ROWS_PROMPT = 32  # ... each with a prompt this long: one short prefill step, then decode steps only


def measure_serving(model_dir: Path, dtype: str, profile, prompt_lens: list[int], progress: bool) -> dict:
    """Per path, what serving adds (see the module docstring): {"aggregated": ..., "disaggregated": ...} from
    one-thread instances, and "aggregated@T" for each larger instance size T the profile holds."""
    common = {"model": str(model_dir), "backend": "shm", "max_restarts": 0}
    vocab, transfer = _vocab(model_dir), TransferCost(profile.transfer["shm"])
    # A KV pool for what the probe holds at once (twice over), not the default GiB: a server zeroes its whole
    # pool at start, and the probe starts three instances. The size of the pool does not change a step's time.
    most = max(max(prompt_lens) + OUTPUT_TOKENS, ROWS * (ROWS_PROMPT + OUTPUT_TOKENS)) + 64 * ROWS
    pool = {"kv_cache_memory_gb": max(1 / 64, 2 * most * profile.kv_bytes_per_token / 2**30)}
    kv = {"kv_cache_dtype": profile.key["kv_cache_dtype"]} if "kv_cache_dtype" in profile.key else {}
    inst = {"num_threads": 1, "dtype": dtype, **kv, **pool}
    ports = [free_port() for _ in range(3)]
    split = dict(common, port=ports[0], context=[{"port": ports[1], "cpus": [0], "config": inst}],
                 generation=[{"port": ports[2], "cpus": [1], "config": inst}])
    out = _probe_cluster(split, profile, vocab, transfer, prompt_lens, progress,
                         [("aggregated", ports[2], ports[2], 1), ("disaggregated", ports[0], ports[1], 1)])
    # A bigger instance is its own case: its threads share the cores with the HTTP server's, the tokenizer's
    # and the orchestrator's, which a one-thread instance on its own core (and the orchestrator off it) does
    # not. Measured behind the orchestrator, as `pdserve launch` deploys an aggregated pick.
    for units in (u for u in profile.units if u > 1):
        ports = [free_port() for _ in range(2)]
        alone = dict(common, port=ports[0], context=[], generation=[
            {"port": ports[1], "cpus": list(range(units)), "config": {"num_threads": units, "dtype": dtype, **kv, **pool}}])
        out |= _probe_cluster(alone, profile, vocab, transfer, prompt_lens, progress,
                              [(f"aggregated@{units}", ports[0], ports[1], units)])
    return out


def _probe_cluster(doc: dict, profile, vocab: int, transfer: TransferCost, prompt_lens: list[int], progress: bool,
                   paths: list[tuple[str, int, int]]) -> dict:
    """Starts the cluster `doc` describes (`pdserve launch`'s fields; its logs in a temporary directory) and
    probes each (name, port, port of the instance that prefills, threads) path of it."""
    from pdserve.launch.config import ClusterConfig
    from pdserve.launch.local import LocalSupervisor

    out = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-probe-") as logs:
        cluster = LocalSupervisor(ClusterConfig(**doc, log_dir=logs))
        try:
            cluster.start()
            gen_port = doc["generation"][0]["port"]
            name = httpx.get(f"http://127.0.0.1:{gen_port}/v1/models", timeout=10).json()["data"][0]["id"]
            for k, (kind, port, engine_port, units) in enumerate(paths):
                ep = EndpointConfig(f"http://127.0.0.1:{port}", name, request_timeout_s=120.0,
                                    engine_metrics=(f"http://127.0.0.1:{engine_port}",))
                moves_kv = kind == "disaggregated"
                out[kind] = _probe_path(ep, vocab, StepCost(profile.steps[units]), transfer,
                                        profile.kv_bytes_per_token if moves_kv else 0, prompt_lens, seed=100 * k,
                                        what=kind)
                if progress:
                    print(f"serving probe, {kind}: prefill x{out[kind]['prefill_factor']:.2f} "
                          f"+{1000 * out[kind]['ttft_s']:.0f} ms per request, "
                          f"+{1000 * out[kind]['itl_s']:.1f} ms per decode step "
                          f"+{1000 * out[kind]['itl_row_s']:.2f} ms per decode row; its engine's prefill "
                          f"steps x{out[kind].get('step_factor', float('nan')):.2f}", flush=True)
            return out
        finally:
            cluster.stop()


def _probe_path(ep, vocab: int, cost: StepCost, transfer: TransferCost, kv_bytes_per_token: int,
                prompt_lens: list[int], *, seed: int, what: str) -> dict:
    """One path's figures: TTFT at each prompt length (less the KV transfer, when kv_bytes_per_token), the extra
    time of a decode step, and of each decode row when ROWS requests decode together."""
    ttft: dict[int, float] = {}
    step: dict[int, float] = {}  # the prefilling engine's own mean prefill step, by prompt length
    itl_extra: list[float] = []
    for n in prompt_lens:
        # one request first warms the path up (and runs the KV canary)
        _requests(ep, vocab, n, 1, seed=seed + n + 1000, concurrency=1, what=f"{what}, {n} tokens, warm-up")
        done, steps = _requests(ep, vocab, n, REPEATS, seed=seed + n, concurrency=1, what=f"{what}, {n} tokens",
                                with_steps=True)
        moved = transfer.seconds(n * kv_bytes_per_token) if kv_bytes_per_token else 0.0
        ttft[n] = statistics.median(r.ttft for r in done) - moved
        prefill = ((steps or {}).get("kinds") or {}).get("prefill")
        if prefill and prefill["steps"] == REPEATS:  # one step per prompt: n fits a step
            step[n] = prefill["seconds"] / prefill["steps"]
        itl_extra += [gap - cost.decode(1, n + i + 1) for r in done for i, gap in enumerate(r.itl)]
    itl_s = max(0.0, statistics.median(itl_extra))
    together = _requests(ep, vocab, ROWS_PROMPT, ROWS, seed=seed + ROWS, concurrency=ROWS,
                         what=f"{what}, {ROWS} at once")
    # Token i + 1 of every request comes from the same step, of ROWS rows each ROWS_PROMPT + i + 1 long.
    rows_extra = [gap - cost.decode(ROWS, ROWS * (ROWS_PROMPT + i + 1))
                  for r in together for i, gap in enumerate(r.itl)]
    out = {**_affine(ttft, cost), "itl_s": itl_s,
           "itl_row_s": max(0.0, (statistics.median(rows_extra) - itl_s) / (ROWS - 1)),
           "ttft_measured_s": {str(n): round(t, 4) for n, t in ttft.items()}}
    if len(step) == len(ttft):
        out |= _by_steps(ttft, step, cost)
    return out


def _requests(ep, vocab: int, prompt_len: int, count: int, *, seed: int, concurrency: int, what: str,
              with_steps: bool = False):
    """`count` streamed requests of random `prompt_len`-token prompts (new ones: no prefix-cache hits), all
    released at once and at most `concurrency` in flight; their records, each checked successful (with_steps:
    and what the engine's steps did meanwhile, server_steps.py's dict, None where it publishes none)."""
    rng = np.random.default_rng(seed)
    reqs = [WorkloadRequest(i, rng.integers(3, vocab, prompt_len).tolist(), prompt_len, OUTPUT_TOKENS)
            for i in range(count)]
    result = asyncio.run(run_requests(ep, reqs, np.zeros(count), max_concurrency=concurrency, max_duration_s=300.0,
                                      progress=False))
    for r in result.records:
        if not r.success:
            raise RuntimeError(f"probe request ({what}) failed: {r.error}")
    return (result.records, result.engine_steps) if with_steps else result.records


def _affine(ttft: dict[int, float], cost: StepCost) -> dict[str, float]:
    """TTFT(n) = ttft_s + prefill_factor x prefill(n), through the shortest and the longest prompt: a server's
    prefill runs slower than the profile's bare forward step (threads, memory), and not by a constant."""
    lo, hi = min(ttft), max(ttft)
    span = cost.prefill(hi) - cost.prefill(lo)
    factor = (ttft[hi] - ttft[lo]) / span if hi > lo and span > 0 else 1.0
    factor = min(max(factor, 0.8), 3.0)
    return {"prefill_factor": factor, "ttft_s": max(0.0, ttft[lo] - factor * cost.prefill(lo))}


def _by_steps(ttft: dict[int, float], step: dict[int, float], cost: StepCost) -> dict[str, float]:
    """The engine's served prefill steps over the bare ones (step_factor), and the TTFT beyond them
    (step_ttft_s: HTTP, tokenizing, queueing for the step loop), the median over the prompt lengths."""
    factor = sum(step.values()) / sum(cost.prefill(n) for n in step)
    factor = min(max(factor, 0.8), 3.0)
    rest = statistics.median(ttft[n] - factor * cost.prefill(n) for n in ttft)
    return {"step_factor": factor, "step_ttft_s": max(0.0, rest),
            "step_measured_s": {str(n): round(s, 4) for n, s in step.items()}}


def _vocab(model_dir: Path) -> int:
    from pdserve.models.config import ModelConfig
    from pdserve.weights.hf_dir import read_config

    return ModelConfig.from_hf(read_config(model_dir)).vocab_size
