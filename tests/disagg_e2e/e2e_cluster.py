"""Real processes for the end-to-end tests: `pdserve serve` worker instances and `pdserve disaggregated`
orchestrators, each in its own process group so teardown kills every rank, even after a failure.

An instance with N ranks is N processes, and the machine has 2 cores: tests share instances through
module- or session-scoped fixtures, start every instance of a group at once (they load in parallel)
and build a small orchestrator per ctx->gen pair (one cheap process, no model)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import yaml

from pdserve.host import free_port

MODEL_NAME = "tiny"
# Worker keys every tiny instance shares; a spec adds its topology, layout, block size and backend.
TINY_BASE = {"served_model_name": MODEL_NAME, "device": "cpu", "max_model_len": 512, "num_kv_blocks": 48,
             "max_num_tokens": 512, "num_threads": 1}
START_TIMEOUT_S = 150.0


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the whole process group (rank 0 and every rank it spawned), then reap rank 0."""
    if proc.poll() is None or _group_alive(proc.pid):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@dataclass(frozen=True)
class Spec:
    """One worker instance: `config` is merged over the model's base keys into its worker.yaml."""

    name: str
    model: str | None  # a model directory; None = the embedded SmolLM2
    config: dict = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return self.config.get("tensor_parallel_size", 1) * self.config.get("pipeline_parallel_size", 1)


class Instance:
    """One `pdserve serve` process group. Construction starts it; `wait_ready` waits for /health."""

    def __init__(self, spec: Spec, workdir: Path, base: dict):
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        cfg_path = workdir / f"{spec.name}.yaml"
        cfg = {**base, **spec.config}
        if spec.model is not None:
            cfg["model"] = spec.model
        cfg_path.write_text(yaml.safe_dump(cfg))
        self.log_path = workdir / f"{spec.name}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "serve", "--config", str(cfg_path),
                 "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def __repr__(self) -> str:
        return f"Instance({self.spec.name} at {self.url})"

    def wait_ready(self, deadline: float) -> "Instance":
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.spec.name} not ready in time:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        _kill_group(self.proc)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of the worker's /metrics (labelled ones summed under their name)."""
        out: dict[str, float] = {}
        text = httpx.get(self.url + "/metrics", timeout=5).text
        for m in re.finditer(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})? (\S+)$", text, re.M):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def wait_blocks_free(self, timeout: float = 15.0) -> None:
        """Wait until every KV block of the pool, and every recurrent-state slot of a hybrid model, is free
        again (none leaked by a request); raise otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            free, total = m["pdserve_kv_cache_blocks_free"], m["pdserve_kv_cache_blocks_total"]
            if free == total and m["pdserve_state_slots_free"] == m["pdserve_state_slots_total"]:
                return
            if time.monotonic() > deadline:
                slots = m["pdserve_state_slots_total"] - m["pdserve_state_slots_free"]
                raise AssertionError(f"{self.spec.name}: {total - free:.0f} of {total:.0f} KV blocks and {slots:.0f} "
                                     f"state slots still allocated {timeout} s after the request ended")
            time.sleep(0.1)


def start_instances(specs: list[Spec], workdir: Path, base: dict) -> dict[str, Instance]:
    """Start every instance at once, then wait for all; on any failure kill them all and raise."""
    started: list[Instance] = []
    try:
        for spec in specs:
            started.append(Instance(spec, workdir, base))
        deadline = time.monotonic() + START_TIMEOUT_S
        for inst in started:
            inst.wait_ready(deadline)
    except BaseException:
        stop_instances(started)
        raise
    return {inst.spec.name: inst for inst in started}


def stop_instances(instances) -> None:
    for inst in instances:
        inst.kill()


class Orchestrator:
    """`python -m pdserve.orchestrator.cli -c disagg.yaml` over one context and one generation instance."""

    def __init__(self, ctx_url: str, gen_url: str, workdir: Path, name: str, **extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = {"hostname": "127.0.0.1", "port": self.port, "context_servers": {"urls": [ctx_url]},
               "generation_servers": {"urls": [gen_url]}, "request_timeout": 60, **extra}
        workdir.mkdir(parents=True, exist_ok=True)
        cfg_path = workdir / f"orch-{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        self.log_path = workdir / f"orch-{name}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve.orchestrator.cli", "--log-level", "WARNING", "-c", str(cfg_path)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout: float = 30.0) -> "Orchestrator":
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"orchestrator exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    return self
                last = r.text
            except httpx.TransportError as e:
                last = repr(e)
            time.sleep(0.05)
        raise RuntimeError(f"orchestrator {self.url} not healthy within {timeout} s: {last}")

    def client(self) -> openai.OpenAI:
        return openai_client(self.url)

    def kill(self) -> None:
        _kill_group(self.proc)

    def __enter__(self) -> "Orchestrator":
        try:
            return self.wait_healthy()
        except BaseException:
            self.kill()
            raise

    def __exit__(self, *exc) -> None:
        self.kill()


def openai_client(url: str, timeout: float = 60.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=timeout, max_retries=0)
