"""What oversized requests cost a real `pdserve serve`: bodies past the size cap, and JSON prompts of
megabytes (valid bodies under the cap). For each: the status, the time to the answer, the server's peak
RSS, the slowest `/health` answer while it was handled (the event loop is shared by every request), and the
longest pause meanwhile in a stream another client is reading (the engine's thread shares the process).
More rows: bodies of millions of numbers (stop_token_ids, a prompt of token ids) and of chat messages.

    python benchmarks/hostile_bodies.py                 # a tiny random-weight model
    python benchmarks/hostile_bodies.py --model DIR     # any model directory or GGUF

Run it on a quiet machine; figures go to docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import psutil

from pdserve.host import free_port
from pdserve.testing import make_tiny_model


def _serve(model: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", model, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{url} did not come up in 300 s")


class _Stream:
    """A streamed completion read in a thread, each event's arrival time kept."""

    def __init__(self, url: str, model: str):
        self.arrivals: list[float] = []
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 100_000, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as c:  # as many tokens as the window leaves
            window = c.post(url + "/tokenize", json={"prompt": "x"}).json()["max_model_len"]
        body["max_tokens"] = window - 16
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()
        while not self.arrivals:
            time.sleep(0.01)

    def _read(self, url: str, body: dict) -> None:
        while not self._stop.is_set():  # a stream that reaches the window starts again
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
                for _ in r.iter_lines():
                    self.arrivals.append(time.monotonic())
                    if self._stop.is_set():
                        return

    def longest_pause(self, start: float, end: float) -> float:
        """The longest gap between two events that overlaps [start, end]."""
        deadline = time.monotonic() + 10
        while self.arrivals[-1] <= end and time.monotonic() < deadline:
            time.sleep(0.01)
        times = self.arrivals[:]
        return max(b - a for a, b in zip(times, times[1:]) if b >= start and a <= end)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def _measure(url: str, server: psutil.Process, send, stream: _Stream) -> tuple[httpx.Response, float, float, float,
                                                                               float]:
    """(answer, seconds, peak RSS MiB, slowest /health in s, longest stream pause in s) of send(), run in a
    thread."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(r=send()))
    start, peak, slowest = time.monotonic(), 0, 0.0
    thread.start()
    while thread.is_alive():
        peak = max(peak, server.memory_info().rss)
        asked = time.monotonic()
        try:
            httpx.get(url + "/health", timeout=120)
        except httpx.HTTPError:
            pass
        slowest = max(slowest, time.monotonic() - asked)
        time.sleep(0.05)
    end = time.monotonic()
    return result["r"], end - start, peak / 2**20, slowest, stream.longest_pause(start, end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory or GGUF (default: a tiny random-weight model)")
    ap.add_argument("--body-mib", type=float, nargs="+", default=[8, 40, 120])
    ap.add_argument("--prompt-mib", type=float, nargs="+", default=[0.5, 2, 8, 30])
    ap.add_argument("--only", nargs="+", metavar="WORDS",
                    help="run only the rows whose name contains one of these (e.g. --only objects 1e308)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_tiny_model(f"{tmp}/tiny", num_layers=2, num_heads=4, num_kv_heads=2,
                                                  head_dim=16))
        proc, url = _serve(model)
        try:
            server = psutil.Process(proc.pid)
            name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            print(f"server idle RSS {server.memory_info().rss / 2**20:.0f} MiB")
            stream = _Stream(url, name)
            print("| request | status | answered in | server peak RSS | slowest /health meanwhile "
                  "| longest pause in another stream |")
            print("|---|---|---|---|---|---|")
            rows = [(f"{mib:g} MiB body (a string field)", b'{"model": "%s", "max_tokens": 1, "pad": "' % name.encode()
                     + b"a" * int(mib * 2**20) + b'"}') for mib in args.body_mib]
            rows += [(f"{mib:g} MiB JSON prompt", json.dumps({"model": name, "max_tokens": 1,
                                                              "prompt": "fox " * int(mib * 2**18)}).encode())
                     for mib in args.prompt_mib]
            many = (list(range(1, 49152)) * 85)[:4_000_000]  # ids below any vocabulary's size, each seen 85 times
            rows += [("4 M stop_token_ids, min_tokens 32", json.dumps(
                         {"model": name, "prompt": "Hello", "max_tokens": 32, "min_tokens": 32, "ignore_eos": True,
                          "temperature": 0, "stop_token_ids": many}).encode()),
                     ("a prompt of 10 M token ids", json.dumps(
                         {"model": name, "prompt": [1] * 10_000_000, "max_tokens": 1}).encode()),
                     ("800 K chat messages of one letter", json.dumps(
                         {"model": name, "messages": [{"role": "user", "content": "a"}] * 800_000,
                          "max_tokens": 1}).encode()),
                     # the parse itself: 30 MiB of small values in a field the server ignores (then a 400:
                     # no prompt)
                     ("30 MiB of {} objects", b'{"model": "%s", "max_tokens": 1, "pad": [' % name.encode()
                      + b"{}, " * (30 * 2**18 - 1) + b"{}]}"),
                     ("30 MiB of 1e308", b'{"model": "%s", "max_tokens": 1, "pad": [' % name.encode()
                      + b"1e308, " * (30 * 2**20 // 7 - 1) + b"1e308]}"),
                     ("30 MiB of empty strings", b'{"model": "%s", "max_tokens": 1, "pad": [' % name.encode()
                      + b'"", ' * (30 * 2**18 - 1) + b'""]}'),
                     ("30 MiB of [] arrays", b'{"model": "%s", "max_tokens": 1, "pad": [' % name.encode()
                      + b"[], " * (30 * 2**18 - 1) + b"[]]}"),
                     # each bad item was 3 validation errors (one per shape of prompt's union): 23 M of them
                     ("30 MiB prompt of {} objects", b'{"model": "%s", "max_tokens": 1, "prompt": [' % name.encode()
                      + b"{}, " * (30 * 2**18 - 1) + b"{}]}")]
            if args.only:
                rows = [(what, body) for what, body in rows if any(w in what for w in args.only)]
            for what, body in rows:
                path = "/v1/chat/completions" if what.endswith("messages of one letter") else "/v1/completions"

                def send(body=body, path=path):
                    return httpx.post(url + path, content=body, timeout=600,
                                      headers={"content-type": "application/json"})
                r, seconds, peak, slowest, pause = _measure(url, server, send, stream)
                print(f"| {what} | {r.status_code} {r.json()['error']['code'] if r.status_code >= 400 else ''} | "
                      f"{seconds:.2f} s | {peak:.0f} MiB | {slowest:.2f} s | {pause:.2f} s |")
            stream.close()
        finally:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
