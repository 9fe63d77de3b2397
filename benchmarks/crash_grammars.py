"""Grammars that crash llguidance's native compiler, sent to a real `pdserve launch` (issue 51's done-when):
N distinct ones (rule chains past what an 8 MiB stack holds, Lark and GBNF by turns) through the
orchestrator, then a normal greedy request, which must answer as it did before them.

    python benchmarks/crash_grammars.py                # the default cluster (SmolLM2, ctx + gen), 100 grammars
    python benchmarks/crash_grammars.py --n 20 --model DIR

It prints the statuses the grammars got, their answer times, the slowest orchestrator `/health` meanwhile,
whether a member restarted (launch's own lines), and whether the answer after equals the answer before.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from pdserve.host import free_port
from pdserve.testing.servers import wait_for_health

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def chain(i: int) -> str:
    """The i-th crashing grammar: a chain of 5,000 + i rules, Lark for even i, GBNF for odd."""
    n = 5000 + i
    if i % 2:
        return "root ::= a0\n" + "".join(f"a{k} ::= a{k + 1}\n" for k in range(n)) + f'a{n} ::= "x"\n'
    return "start: r0\n" + "".join(f"r{k}: r{k + 1}\n" for k in range(n)) + f'r{n}: "x"\n'


def _launch(args, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "launch", "--port", str(port)]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_for_health(url, proc, lambda: log.read_text()[-3000:], timeout=600)
    return proc, url


def _answer(http: httpx.Client, model: str) -> str:
    r = http.post("/v1/chat/completions", json={"model": model, "messages": PROMPT, "temperature": 0,
                                                 "max_tokens": 24})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100, help="distinct crashing grammars to send")
    ap.add_argument("--model", default=None, help="model directory or GGUF (default: the embedded SmolLM2)")
    args = ap.parse_args()
    log = Path(tempfile.mkdtemp(prefix="crash-grammars-")) / "launch.log"
    proc, url = _launch(args, log)
    slowest, stop = 0.0, threading.Event()

    def watch() -> None:
        nonlocal slowest
        with httpx.Client(base_url=url, timeout=30) as h:
            while not stop.is_set():
                t = time.perf_counter()
                h.get("/health")
                slowest = max(slowest, time.perf_counter() - t)
                time.sleep(0.05)

    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            before = _answer(http, model)
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            statuses, times = collections.Counter(), []
            for i in range(args.n):
                t = time.perf_counter()
                r = http.post("/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 2,
                                                       "structured_outputs": {"grammar": chain(i)}})
                times.append(time.perf_counter() - t)
                statuses[r.status_code] += 1
            stop.set()
            watcher.join()
            after = _answer(http, model)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    text = log.read_text()
    print("| grammars | statuses | answer median / max s | slowest /health s | member restarts | "
          "answer after equals before |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.n} | {dict(statuses)} | {statistics.median(times):.2f} / {max(times):.2f} | {slowest:.2f} | "
          f"{text.count('restarting it in')} | {after == before} |")
    print(f"\nanswer: {after!r}\nlaunch log: {log}")


if __name__ == "__main__":
    main()
