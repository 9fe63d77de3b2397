"""`pdserve launch [cluster.yaml]`: a whole local disaggregated cluster in one command.

Starts every context and generation instance (`pdserve serve`) and the orchestrator
(`pdserve disaggregated`), each in its own process group with its log file, waits until all answer
/health, prints where everything is, and on Ctrl-C or SIGTERM stops them all (SIGTERM, then SIGKILL
after a grace period), so no process outlives the command; killed with SIGKILL, it cannot stop them, so
the kernel sends each its SIGTERM (PR_SET_PDEATHSIG). A member that dies is restarted, after a
backoff that doubles each time (restart_backoff_s, 2x, ...), at most max_restarts times; the
orchestrator routes to it again once it answers /health. One that dies once more than that stops the
cluster, and the command exits non-zero, naming it and the end of its log.

Without a file it starts one context and one generation instance of the embedded SmolLM2, KV over
shared memory, and the orchestrator on 127.0.0.1:8000. `context: []` launches an aggregated
deployment: the generation instances serve whole requests, the orchestrator routes between them.

Every member gets the cluster's `cluster_token` (a new random one unless the file sets it): the
orchestrator as its cluster_token, every instance as cache_transceiver_config.cluster_token. It travels
in the members' config files (mode 0600, never on a command line), and launch writes it to the file
`cluster_token` (0600) in its log directory for an operator who joins more instances by hand.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.config import WorkerConfig, load_yaml


class InstanceSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    port: int | None = Field(None, ge=1, le=65535, description="default: orchestrator port + 1, + 2, ...")
    cpus: list[int] | None = Field(None, description="pin the instance's processes to these CPU cores")
    config: dict[str, Any] = Field(default_factory=dict, description="worker keys (docs/configuration.md)")


class RayOptions(BaseModel):
    """`pdserve launch --ray` only (launch_ray.py)."""

    model_config = ConfigDict(extra="forbid")

    cpus_per_rank: float = Field(1.0, gt=0, description="Ray CPUs reserved for each rank of an instance (and its "
                                                        "num_threads unless its config sets one)")
    gpus_per_rank: float = Field(0.0, ge=0, description="Ray GPUs reserved for each rank of an instance")
    placement_timeout_s: float = Field(60.0, gt=0, description="s to wait for Ray to find room for an instance")
    placement: Literal["pack", "spread"] = Field(
        "pack", description="pack: an instance goes wherever Ray finds room; spread: each instance on a node "
                            "that holds no other instance of the cluster (an instance's ranks share a node "
                            "either way)")


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="model of every instance unless its config names one")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535, description="the orchestrator's public port")
    backend: str = Field("shm", description="cache_transceiver_config.backend unless an instance sets it")
    log_dir: str | None = Field(None, description="default: a new directory under the system temp dir")
    startup_timeout: float = Field(600.0, gt=0)
    context: list[InstanceSpec] = Field(default_factory=lambda: [InstanceSpec()],
                                        description="[]: aggregated, the generation instances serve whole requests")
    generation: list[InstanceSpec] = Field(default_factory=lambda: [InstanceSpec()], min_length=1)
    orchestrator: dict[str, Any] = Field(default_factory=dict, description="extra disagg.yaml keys (routers, ...)")
    max_restarts: int = Field(3, ge=0, description="restarts of one member that died before the cluster stops")
    restart_backoff_s: float = Field(1.0, ge=0, description="wait before a member's first restart; doubles each time")
    ray: RayOptions = Field(default_factory=RayOptions, description="placement on a Ray cluster (--ray)")
    cluster_token: str | None = Field(
        None, min_length=1, repr=False,
        description="the cluster's secret, given to every member; default: the orchestrator's or an instance's "
                    "cluster_token if the file sets one, else a new random one")

    @model_validator(mode="after")
    def _ports(self) -> "ClusterConfig":
        taken = {self.port}
        for i, inst in enumerate(self.context + self.generation):
            if inst.port is None:
                inst.port = self.port + 1 + i
            if inst.port in taken:
                raise ValueError(f"port {inst.port} is used twice in the cluster config")
            taken.add(inst.port)
        return self

    @model_validator(mode="after")
    def _one_token(self) -> "ClusterConfig":
        """Every member holds the same cluster_token: the one the file sets (anywhere), or a new one."""
        set_on = {"cluster_token": self.cluster_token, "orchestrator": self.orchestrator.get("cluster_token")}
        for role, i, spec in instances(self):
            set_on[f"{role}{i}"] = (spec.config.get("cache_transceiver_config") or {}).get("cluster_token")
        given = {k: v for k, v in set_on.items() if v is not None}
        if len(set(given.values())) > 1:
            raise ValueError(f"{', '.join(given)} set different cluster tokens: a cluster has one (set "
                             "cluster_token once, at the top of the cluster config)")
        self.cluster_token = next(iter(given.values()), None) or secrets.token_urlsafe(32)
        self.orchestrator = {**self.orchestrator, "cluster_token": self.cluster_token}
        for _, _, spec in instances(self):
            transceiver = spec.config.get("cache_transceiver_config") or {}
            if isinstance(transceiver, dict):  # anything else is the worker config's to refuse
                spec.config = {**spec.config, "cache_transceiver_config": {**transceiver,
                                                                           "cluster_token": self.cluster_token}}
        return self


_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child between fork and exec (Linux): the kernel sends it `sig` when the process that started it
    dies, by any signal, SIGKILL included; otherwise a killed launcher would leave its servers running."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


class Member:
    """One process group of the cluster and its log."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, health_url: str, cpus: list[int] | None):
        self.name, self.log_path, self.health_url = name, log_path, health_url
        self.cmd, self.cpus = cmd, cpus
        self.restarts = 0
        self.proc = self._spawn("wb")

    def _spawn(self, mode: str) -> subprocess.Popen:
        log = open(self.log_path, mode)
        cpus = self.cpus

        def prepare() -> None:  # in the child: stop with launch, even a launch killed -9; its cores
            die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)

        try:
            return subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=prepare)
        finally:
            log.close()

    def restart(self) -> None:
        """Start the member again; its log goes on in the same file."""
        self.restarts += 1
        self.proc = self._spawn("ab")

    def healthy(self) -> bool:
        try:
            return httpx.get(self.health_url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float) -> None:
        self.terminate()
        self.reap(time.monotonic() + grace_s)

    def terminate(self) -> None:
        """SIGTERM to the member's process group: it drains and exits (see `reap`)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def reap(self, deadline: float) -> None:
        """Wait for the terminated member until the monotonic `deadline`, then SIGKILL what is left."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


class Cluster:
    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="pdserve-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.token_path = self.log_dir / "cluster_token"
        self.members: list[Member] = []

    def _worker(self, role: str, index: int, spec: InstanceSpec, conf: dict) -> Member:
        path = self.log_dir / f"{role}{index}.yaml"
        write_private(path, yaml.safe_dump({k: v for k, v in conf.items() if v is not None}))
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--config", str(path)]
        return Member(f"{role}{index}", cmd, self.log_dir / f"{role}{index}.log",
                      f"http://{self.cfg.host}:{spec.port}/health", spec.cpus)

    def start(self) -> None:
        cfg = self.cfg
        write_private(self.token_path, cfg.cluster_token + "\n")
        for (role, i, spec), conf in zip(instances(cfg), worker_configs(cfg)):
            self.members.append(self._worker(role, i, spec, conf))
        self._wait_healthy(self.members)
        aggregated = {} if cfg.context else {"minimal_instances": 0}  # see orchestrator.py, _aggregated
        disagg = {"hostname": cfg.host, "port": cfg.port, **cfg.orchestrator,
                  "context_servers": {**aggregated, **cfg.orchestrator.get("context_servers", {}),
                                      "urls": [f"http://{cfg.host}:{s.port}" for s in cfg.context]},
                  "generation_servers": {**cfg.orchestrator.get("generation_servers", {}),
                                         "urls": [f"http://{cfg.host}:{s.port}" for s in cfg.generation]}}
        path = self.log_dir / "disagg.yaml"
        write_private(path, yaml.safe_dump(disagg))
        orch = Member("orchestrator", [sys.executable, "-m", "pdserve.orchestrator.cli", "-c", str(path)],
                      self.log_dir / "orchestrator.log", f"http://{cfg.host}:{cfg.port}/health", None)
        self.members.append(orch)
        self._wait_healthy([orch])

    def _wait_healthy(self, members: list[Member]) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout
        pending = list(members)
        while pending:
            for m in list(pending):
                if m.proc.poll() is not None:
                    raise RuntimeError(f"{m.name} exited with code {m.proc.returncode} while starting; "
                                       f"end of {m.log_path}:\n{m.log_tail()}")
                if m.healthy():
                    print(f"  {m.name:<13} ready   {m.health_url.rsplit('/', 1)[0]}   log {m.log_path}", flush=True)
                    pending.remove(m)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(m.name for m in pending)} not ready after "
                                   f"{self.cfg.startup_timeout:.0f} s; see their logs in {self.log_dir}")
            time.sleep(0.5)

    def watch(self, stop_requested) -> Member | None:
        """Block until a stop is requested (returns None) or a member dies past its restarts (returns it).
        A member that dies with restarts left is started again after its backoff."""
        while not stop_requested():
            for m in self.members:
                if m.proc.poll() is None:
                    continue
                if m.restarts >= self.cfg.max_restarts:
                    return m
                wait = self.cfg.restart_backoff_s * 2 ** m.restarts
                print(f"pdserve launch: {m.name} exited with code {m.proc.returncode}; restarting it in {wait:g} s "
                      f"(restart {m.restarts + 1} of {self.cfg.max_restarts}). End of {m.log_path}:\n"
                      f"{m.log_tail()}", file=sys.stderr, flush=True)
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline and not stop_requested():
                    time.sleep(0.1)
                if stop_requested():
                    return None
                m.restart()
                print(f"pdserve launch: {m.name} restarted (pid {m.proc.pid})", flush=True)
            time.sleep(0.5)
        return None

    def stop(self, grace_s: float = 15.0) -> None:
        """The orchestrator first, so no new work reaches the workers; then every worker at once (each drains
        on its own), all within `grace_s` of that."""
        workers = [m for m in self.members if m.name != "orchestrator"]
        for m in self.members:
            if m.name == "orchestrator":
                m.stop(grace_s)
        for m in workers:
            m.terminate()
        deadline = time.monotonic() + grace_s
        for m in workers:
            m.reap(deadline)


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read (it holds the cluster token), whatever was there before."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)


def instances(cfg: ClusterConfig) -> list[tuple[str, int, InstanceSpec]]:
    return [("ctx", i, s) for i, s in enumerate(cfg.context)] + [("gen", i, s) for i, s in enumerate(cfg.generation)]


def worker_configs(cfg: ClusterConfig) -> list[dict]:
    """Each instance's worker config, validated (a bad one stops the launch before anything starts)."""
    members = instances(cfg)
    threads = max(1, (os.cpu_count() or 1) // sum(_ranks(s.config) for _, _, s in members))
    out = []
    for role, i, spec in members:
        conf = {"model": cfg.model, "num_threads": threads, "host": cfg.host, **spec.config, "port": spec.port}
        if cfg.context:  # aggregated (no context instance): no KV moves
            conf["cache_transceiver_config"] = {"backend": cfg.backend, **conf.get("cache_transceiver_config", {})}
        if role == "ctx":
            conf.setdefault("kv_events_port", 0)
            # It only runs context_only requests (prefill and first token), never a decode step, so it
            # need not keep the batch-1 decode copy of its weights.
            conf.setdefault("cpu_decode_gemv", False)
        try:
            load_yaml(None, WorkerConfig, **conf)
        except ValueError as e:
            raise ValueError(f"{role}{i}: {e}") from None
        out.append(conf)
    return out


def _ranks(worker_conf: dict) -> int:
    return int(worker_conf.get("tensor_parallel_size", 1)) * int(worker_conf.get("pipeline_parallel_size", 1))


def load_cluster_config(path: str | None) -> ClusterConfig:
    return load_yaml(path, ClusterConfig)


def checked_cluster_config(path: str | None) -> ClusterConfig | None:
    """The cluster config with every instance's worker config validated, or None after saying what is wrong."""
    try:
        cfg = load_cluster_config(path)
        worker_configs(cfg)
        return cfg
    except ValueError as e:
        print(f"pdserve launch: error: {e}", file=sys.stderr)
        return None


def unusable_cores(cfg: ClusterConfig) -> str | None:
    """Why an instance's `cpus` cannot be honoured on this machine, or None. (The kernel would pin an
    instance to the cores of its list that exist and say nothing of the others, or refuse a list of
    none at the child's start.)"""
    usable = os.sched_getaffinity(0)
    for role, i, spec in instances(cfg):
        missing = sorted(set(spec.cpus or ()) - usable)
        if missing:
            return (f"{role}{i} is pinned to cores {spec.cpus}, and {missing} {'is' if len(missing) == 1 else 'are'} "
                    f"not among the cores this process may use ({sorted(usable)}): fix its cpus")
    return None


def unsplittable_models(cfg: ClusterConfig) -> str | None:
    """Why an instance's model cannot be split as its tensor and pipeline parallel sizes ask, or None.
    Each model is resolved here, before any instance starts: a GGUF is converted once for all of them, and a
    layout that cannot work stops the launch before the other instances are up."""
    from pdserve.models.config import ModelConfig
    from pdserve.weights import read_config, resolve_model

    for (role, i, _), conf in zip(instances(cfg), worker_configs(cfg)):
        try:
            model = ModelConfig.from_hf(read_config(resolve_model(conf.get("model"), cache_dir=conf.get("cache_dir"))))
        except (ValueError, OSError) as e:
            return f"{role}{i}: {e}"
        why = model.layout_problem(int(conf.get("tensor_parallel_size", 1)), int(conf.get("pipeline_parallel_size", 1)))
        if why is not None:
            return f"{role}{i}: {why}"
    return None


def launch(path: str | None) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # health probes are not news
    cfg = checked_cluster_config(path)
    if cfg is None:
        return 1
    why = unusable_cores(cfg) or unsplittable_models(cfg)
    if why is not None:
        print(f"pdserve launch: error: {why}", file=sys.stderr)
        return 1
    cluster = Cluster(cfg)
    stop = {"now": False}

    def on_signal(signum, _frame):
        stop["now"] = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    shape = (f"{len(cfg.context)} context + {len(cfg.generation)} generation instance(s)" if cfg.context else
             f"aggregated, {len(cfg.generation)} instance(s) behind the orchestrator")
    print(f"pdserve launch: {shape}; logs in {cluster.log_dir}; cluster token in {cluster.token_path} "
          "(mode 0600; an instance joins with it as cache_transceiver_config.cluster_token)", flush=True)
    try:
        cluster.start()
        url = f"http://{cfg.host}:{cfg.port}"
        print(f"\nready: OpenAI API at {url}/v1 (Ctrl-C stops everything)\n\n"
              f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              f"    -d '{{\"model\": \"{_model_name(cfg)}\", \"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"What is the capital of France?\"}}], \"temperature\": 0, \"max_tokens\": 64}}'\n",
              flush=True)
        dead = cluster.watch(lambda: stop["now"])
        if dead is not None:
            print(f"pdserve launch: {dead.name} exited with code {dead.proc.returncode} after {dead.restarts} "
                  f"restart(s); stopping the cluster.\nend of {dead.log_path}:\n{dead.log_tail()}", file=sys.stderr)
            return 1
        return 0
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"pdserve launch: error: {e}", file=sys.stderr)
        return 1
    finally:
        print("pdserve launch: stopping...", flush=True)
        cluster.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        print("pdserve launch: stopped.", flush=True)


def _model_name(cfg: ClusterConfig) -> str:
    conf = cfg.generation[0].config
    if conf.get("served_model_name"):
        return conf["served_model_name"]
    model = conf.get("model", cfg.model)
    if model is None:
        return "SmolLM2-135M-Instruct"
    return Path(model).stem if model.endswith(".gguf") else Path(model).name
