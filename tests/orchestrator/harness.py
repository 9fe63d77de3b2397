"""Helpers for the orchestrator tests: real `pdserve serve` worker processes, an orchestrator app in a
thread on a port the OS chose, and a probe for whether workers support disaggregated requests yet."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml

from pdserve.host import free_port
from pdserve.testing.servers import UvicornThread

MODEL_NAME = "tiny"
TOKENS_PER_BLOCK = 8
WORKER_CONFIG = {"served_model_name": MODEL_NAME, "device": "cpu", "max_model_len": 256, "num_kv_blocks": 64,
                 "tokens_per_block": TOKENS_PER_BLOCK, "max_num_tokens": 256, "num_threads": 1}


class Worker:
    """One `pdserve serve` process over the tiny model. `extra` is merged into its worker.yaml."""

    def __init__(self, model_dir: Path, workdir: Path, extra: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg_path = workdir / f"worker-{self.port}.yaml"
        cfg_path.write_text(yaml.safe_dump({**WORKER_CONFIG, **(extra or {})}))
        self.log_path = workdir / f"worker-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "serve",
                                      str(model_dir), "--port", str(self.port), "--config", str(cfg_path)],
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 90) -> "Worker":
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.url} not ready within {timeout} s")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log.close()

    def metric(self, name: str) -> float:
        """Sum of every sample of `name` (all label sets) in the worker's /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def start_workers(model_dir: Path, workdir: Path, n: int, extra: dict | None = None) -> list[Worker]:
    return start_each(model_dir, workdir, [extra] * n)


def start_each(model_dir: Path, workdir: Path, extras: list[dict | None]) -> list[Worker]:
    """One worker per entry of `extras` (merged into its worker.yaml). All start, then all are waited
    for: they load in parallel. A worker that needs a port of its own beside its HTTP one asks for
    port 0 (e.g. `kv_events_port: 0`), so none has to be up before the next one starts."""
    workers = [Worker(model_dir, workdir, extra) for extra in extras]
    try:
        return [w.wait_ready() for w in workers]
    except Exception:
        for w in workers:
            w.stop()
        raise


def free_port_pair() -> int:
    """A port P with P-1 free too (the coordinator's default)."""
    for _ in range(50):
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port - 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def run_cli(tmp_path, cfg: dict, log_level: str = "WARNING") -> subprocess.Popen:
    """`pdserve disaggregated -c` over `cfg`; its output goes to tmp_path/orchestrator.log (a pipe nobody
    reads while it runs could fill up and stall it). `log_of(proc)` reads it."""
    path = tmp_path / "disagg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(tmp_path / "orchestrator.log", "w")
    argv = [sys.executable, "-m", "pdserve.orchestrator.cli", "--log-level", log_level, "-c", str(path)]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log_path = tmp_path / "orchestrator.log"
    log.close()
    return proc


def log_of(proc: subprocess.Popen) -> str:
    return proc.log_path.read_text()[-4000:]


class AppThread(UvicornThread):
    def __init__(self, app):
        super().__init__(app, name="the orchestrator app")


def wait_healthy(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200:
                return
            last = r.text
        except httpx.TransportError as e:
            last = repr(e)
        time.sleep(0.05)
    raise RuntimeError(f"{url}/health not 200 within {timeout} s: {last}")


def worker_supports_disagg(url: str) -> bool:
    """True when the worker answers /v1/disagg_info with a non-null transceiver backend."""
    try:
        r = httpx.get(url + "/v1/disagg_info", timeout=5)
        return r.status_code == 200 and r.json().get("backend") is not None
    except (httpx.HTTPError, ValueError):
        return False


def worker_config_has_transceiver() -> bool:
    """Whether `pdserve serve` accepts cache_transceiver_config yet (the worker side of this feature)."""
    from pdserve.config import WorkerConfig

    return "cache_transceiver_config" in WorkerConfig.model_fields


class Occupied:
    """Keeps a worker started with max_num_seqs 1 busy for seconds: a queue of `n` long greedy requests
    (about 0.15 s each on this machine). A request sent to it meanwhile waits its turn, unscheduled."""

    def __init__(self, worker: Worker, n: int = 48, prompt: list[int] | None = None):
        self.worker, self.n = worker, n
        self.body = {"model": MODEL_NAME, "prompt": prompt or list(range(30, 70)), "max_tokens": 210,
                     "temperature": 0, "ignore_eos": True}
        self.pool = ThreadPoolExecutor(n)
        self.futures = []

    def __enter__(self) -> "Occupied":
        url = self.worker.url + "/v1/completions"
        self.futures = [self.pool.submit(httpx.post, url, json=self.body, timeout=120) for _ in range(self.n)]
        deadline = time.monotonic() + 10
        while self.worker.metric("pdserve_num_requests_waiting") < self.n // 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def statuses(self) -> list[int]:
        return [f.result(timeout=120).status_code for f in self.futures]

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def router_views(orch_url: str) -> dict[str, dict]:
    """The orchestrator's view of each instance (/cluster_info), by URL, both roles."""
    info = httpx.get(orch_url + "/cluster_info", timeout=5).json()
    return {i["url"]: i for role in ("context_servers", "generation_servers") for i in info[role]["instances"]}


def caught_up(orch_url: str, workers, timeout: float = 10.0) -> dict[str, dict]:
    """The router's view of each worker once it has applied every KV event the worker published (its seq equal
    to the worker's own snapshot's): a count read then is the router's settled one, not one still in flight."""
    deadline = time.monotonic() + timeout
    while True:
        views = router_views(orch_url)
        seqs = {w.url: httpx.get(w.url + "/v1/kv_blocks", timeout=5).json()["seq"] for w in workers}
        if all(views[url]["kv_events_seq"] == seq for url, seq in seqs.items()):
            return views
        assert time.monotonic() < deadline, f"the router's KV event seqs {views} never reached the workers' {seqs}"
        time.sleep(0.05)
