"""Fault script: short greedy requests through a real disaggregated cluster whose KV transfers fail on
purpose, then a table of what came back.

    python benchmarks/fault_suite.py [--requests 1000] [--concurrency 8] [--write-failure-rate 0.05]
                                     [--drop-rate 0.0] [--corrupt-rate 0.0] [--no-checksum]
                                     [--kill-context-at N] [--stream] [--max-tokens M]
                                     [--kill-generation-at N] [--no-migrate]

It starts `pdserve serve` processes over a tiny random-weight model (two context instances and one
generation instance, shm transfers), and the orchestrator (`pdserve disaggregated`). The context
instances fail that share of their KV writes and the generation instance loses that share of its
write notifications (cache_transceiver_config.fault_injection); `--corrupt-rate` makes that share of
the context writes land with one byte inverted, which the generation instance's KV checksums
(cache_transceiver_config.checksum, on unless --no-checksum) must catch. Each answer is sorted as right (equal
to the generation instance's own aggregated greedy output), wrong (a 200 with other text), a clear
error (an OpenAI error body), or a hang (no answer within the client's timeout). Afterwards every
instance must hold no KV block. `--kill-context-at N` kills one context instance with SIGKILL once N
requests were answered; the measured times are to its first error and until answers are right again.
`--kill-generation-at N` starts a second generation instance and kills the one holding the most KV
(the one decoding) the same way; with `--stream` (and a longer `--max-tokens`) that lands mid-stream, where
the orchestrator moves each cut stream to the other instance (`--no-migrate`: migrate_streams off, and
each cut stream ends with an error event). A streamed answer is right when its text, read to [DONE],
equals the reference; an error event in it makes it a clear error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from pdserve.host import free_port
from pdserve.testing import make_tiny_model

MODEL = "tiny"
WORKER = {"served_model_name": MODEL, "device": "cpu", "max_model_len": 256, "num_kv_blocks": 256,
          "tokens_per_block": 8, "max_num_tokens": 256, "num_threads": 1}


class Proc:
    def __init__(self, args: list[str], log: Path):
        self.log_path = log
        self._log = open(log, "w")
        level = os.environ.get("PDSERVE_LOG_LEVEL", "WARNING")
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "--log-level", level, *args],
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self._log.close()


def start_worker(model_dir: Path, workdir: Path, faults: dict | None, timeout_ms: int,
                 checksum: bool = False) -> tuple[Proc, str]:
    port = free_port()
    cfg = {**WORKER, "kv_events_port": free_port(),
           "cache_transceiver_config": {"backend": "shm", "kv_transfer_timeout_ms": timeout_ms,
                                        "rank_info_timeout_s": 2.0, "fault_injection": faults,
                                        "checksum": checksum}}
    path = workdir / f"worker-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return Proc(["serve", str(model_dir), "--port", str(port), "--config", str(path)],
                workdir / f"worker-{port}.log"), f"http://127.0.0.1:{port}"


def wait_ready(url: str, path: str = "/health", timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {timeout} s")


def blocks_held(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    values = {m.group(1): float(m.group(2)) for m in
              re.finditer(r"^(pdserve_kv_cache_blocks_(?:free|total)) (\S+)$", text, re.M)}
    return values["pdserve_kv_cache_blocks_total"] - values["pdserve_kv_cache_blocks_free"]


def prompt_for(i: int) -> list[int]:
    return [3 + (i * 7919 + j * 104729) % 490 for j in range(8 + i % 25)]


async def run(args) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-faults-"))
    model_dir = make_tiny_model(workdir / "tiny", num_layers=2, num_heads=4, num_kv_heads=2,
                                max_position_embeddings=512)
    procs, ctx_urls = [], []
    for k in range(2):
        faults = {"write_failure_rate": args.write_failure_rate, "corrupt_rate": args.corrupt_rate,
                  "seed": args.seed + k}
        proc, url = start_worker(model_dir, workdir, faults, args.timeout_ms)
        procs.append(proc)
        ctx_urls.append(url)
    gen_urls = []
    for k in range(1 + (args.kill_generation_at is not None)):
        gen_proc, gen_url = start_worker(model_dir, workdir, {"drop_notification_rate": args.drop_rate,
                                                             "seed": args.seed + 7 + k}, args.timeout_ms,
                                         checksum=args.checksum)
        procs.append(gen_proc)
        gen_urls.append(gen_url)
    orch_port = free_port()
    orch_cfg = workdir / "disagg.yaml"
    orch_cfg.write_text(yaml.safe_dump({"port": orch_port, "context_servers": {"urls": ctx_urls},
                                        "generation_servers": {"urls": gen_urls}, "max_retries": 1,
                                        "health_check_interval": 1.0, "migrate_streams": args.migrate}))
    orch = Proc(["disaggregated", "-c", str(orch_cfg)], workdir / "orchestrator.log")
    orch_url = f"http://127.0.0.1:{orch_port}"
    try:
        for url in [*ctx_urls, *gen_urls]:
            wait_ready(url)
        wait_ready(orch_url)
        limits = httpx.Limits(max_connections=args.concurrency * 2)
        async with httpx.AsyncClient(timeout=args.client_timeout, limits=limits) as http:
            prompts = [prompt_for(i) for i in range(args.distinct_prompts)]
            body = {"model": MODEL, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            reference = [(await http.post(gen_urls[0] + "/v1/completions", json={**body, "prompt": p})).json()
                         ["choices"][0]["text"] for p in prompts]
            outcomes: list[tuple[str, float, float]] = []  # (kind, latency s, finished at)
            killed_at: list[float] = []
            killed: list[int] = []  # index in procs of the instance killed
            sem = asyncio.Semaphore(args.concurrency)

            def kill_now() -> None:
                killed_at.append(time.monotonic())
                if args.kill_context_at is not None:
                    killed.append(0)
                else:  # the generation instance decoding the most
                    held = [blocks_held(u) for u in gen_urls]
                    killed.append(len(ctx_urls) + held.index(max(held)))
                procs[killed[0]].kill()

            async def answer(prompt: list[int]) -> str:
                """The outcome of one request: right, wrong, error or unclear."""
                request = {**body, "prompt": prompt, "stream": args.stream}
                if not args.stream:
                    r = await http.post(orch_url + "/v1/completions", json=request)
                    if r.status_code != 200:
                        return "error" if r.json().get("error", {}).get("message") else "unclear"
                    return r.json()["choices"][0]["text"]
                text = ""
                async with http.stream("POST", orch_url + "/v1/completions", json=request) as r:
                    if r.status_code != 200:
                        await r.aread()
                        return "error" if r.json().get("error", {}).get("message") else "unclear"
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            return text
                        if line.startswith("data: "):
                            event = json.loads(line[6:])
                            if "error" in event:
                                return "error" if event["error"].get("message") else "unclear"
                            text += event["choices"][0]["text"] if event["choices"] else ""
                return "unclear"  # closed without [DONE]

            async def one(i: int) -> None:
                async with sem:
                    kill_at = args.kill_context_at if args.kill_context_at is not None else args.kill_generation_at
                    if kill_at is not None and len(outcomes) >= kill_at and not killed_at:
                        kill_now()
                    start = time.monotonic()
                    try:
                        got = await answer(prompts[i % len(prompts)])
                        if got in ("error", "unclear"):
                            kind = got
                        else:
                            kind = "right" if got == reference[i % len(prompts)] else "wrong"
                    except httpx.TimeoutException:
                        kind = "hang"
                    except httpx.HTTPError:
                        kind = "unclear"
                    outcomes.append((kind, time.monotonic() - start, time.monotonic()))

            started = time.monotonic()
            await asyncio.gather(*(one(i) for i in range(args.requests)))
            wall = time.monotonic() - started
        live = [u for k, u in enumerate([*ctx_urls, *gen_urls]) if k not in killed]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(blocks_held(u) for u in live):
            await asyncio.sleep(0.1)
        held = {u: blocks_held(u) for u in live}
        metrics = httpx.get(orch_url + "/metrics", timeout=5).text
        retried = {m.group(1): float(m.group(2)) for m in
                   re.finditer(r'^pdserve_orchestrator_retries_total{role="(\w+)"} (\S+)$', metrics, re.M)}
        moved = float(re.search(r'^pdserve_orchestrator_stream_moves_total (\S+)$', metrics, re.M).group(1))
    finally:
        for p in [orch, *procs]:
            p.kill(signal.SIGTERM)
    injected = {}
    for p in procs:
        for m in re.finditer(r"injected (\{.*?\})", p.log_path.read_text()):
            for k, v in parse_counts(m.group(1)).items():
                injected[k] = injected.get(k, 0) + v
    count = {k: sum(1 for o in outcomes if o[0] == k) for k in ("right", "wrong", "error", "unclear", "hang")}
    errors = [o[1] for o in outcomes if o[0] == "error"]
    rows = [("requests", args.requests), ("concurrency", args.concurrency),
            ("write failure rate (context)", args.write_failure_rate),
            ("notification drop rate (generation)", args.drop_rate),
            ("corrupt write rate (context)", args.corrupt_rate),
            ("KV checksums (generation)", "on" if args.checksum else "off"),
            ("streamed, max_tokens", f"{'yes' if args.stream else 'no'}, {args.max_tokens}"),
            ("injected: failed writes", injected.get("failed_writes", "n/a")),
            ("injected: dropped notifications", injected.get("dropped_notifications", "n/a")),
            ("injected: corrupted writes", injected.get("corrupted_writes", "n/a")),
            ("right (equal to aggregated greedy)", count["right"]), ("wrong (200, other text)", count["wrong"]),
            ("clear errors", count["error"]), ("unclear failures", count["unclear"]), ("hangs", count["hang"]),
            ("KV blocks held afterwards", int(sum(held.values()))),
            ("orchestrator retries: context / generation", f"{retried.get('context', 0):g} / "
                                                           f"{retried.get('generation', 0):g}"),
            ("streams moved to another instance", f"{moved:g}"),
            ("time to error p50 / max (s)", f"{statistics.median(errors):.3f} / {max(errors):.3f}" if errors else "-"),
            ("wall time (s)", f"{wall:.1f}")]
    if killed_at:
        after = sorted(o for o in outcomes if o[2] > killed_at[0])
        first_error = next((o[2] - killed_at[0] for o in after if o[0] != "right"), None)
        last_bad = max((o[2] for o in after if o[0] != "right"), default=None)
        rows += [(f"{'context' if args.kill_context_at is not None else 'generation'} instance killed after answers",
                  args.kill_context_at if args.kill_context_at is not None else args.kill_generation_at),
                 ("streams moved (migrate_streams)", "on" if args.migrate else "off"),
                 ("first non-right answer after the kill (s)", f"{first_error:.2f}" if first_error else "none"),
                 ("last non-right answer after the kill (s)",
                  f"{last_bad - killed_at[0]:.2f}" if last_bad else "none")]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure'.ljust(width)} | value\n{'-' * width}-|------")
    for name, value in rows:
        print(f"{name.ljust(width)} | {value}")
    print(f"\nlogs: {workdir}")


def parse_counts(text: str) -> dict[str, int]:
    """The counts a FaultyAgent logs at shutdown, e.g. {'failed_writes': 3, ...}."""
    return {k: int(v) for k, v in re.findall(r"'(\w+)': (\d+)", text)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--distinct-prompts", type=int, default=50)
    ap.add_argument("--write-failure-rate", type=float, default=0.05)
    ap.add_argument("--drop-rate", type=float, default=0.0)
    ap.add_argument("--corrupt-rate", type=float, default=0.0)
    ap.add_argument("--no-checksum", dest="checksum", action="store_false",
                    help="the generation instance does not check KV checksums (a corrupted byte then goes unseen)")
    ap.add_argument("--timeout-ms", type=int, default=2000, help="kv_transfer_timeout_ms of every instance")
    ap.add_argument("--client-timeout", type=float, default=60.0)
    ap.add_argument("--kill-context-at", type=int, default=None)
    ap.add_argument("--kill-generation-at", type=int, default=None)
    ap.add_argument("--stream", action="store_true", help="stream each answer (read to [DONE])")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--no-migrate", dest="migrate", action="store_false",
                    help="the orchestrator's migrate_streams off: a cut stream ends with an error event")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.kill_context_at is not None and args.kill_generation_at is not None:
        ap.error("kill one instance per run: --kill-context-at or --kill-generation-at")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
