"""`pdserve launch [cluster.yaml]`: a whole local disaggregated cluster in one command.

Starts every context and generation instance (`pdserve serve`) and the orchestrator
(`pdserve disaggregated`), each in its own process group with its log file, waits until all answer
/health, prints where everything is, and on Ctrl-C or SIGTERM stops them all (SIGTERM, then SIGKILL
after a grace period), so no process outlives the command; killed with SIGKILL, it cannot stop them, so
the kernel sends each its SIGTERM (PR_SET_PDEATHSIG). A member that dies is restarted as often as it
dies, after a wait that doubles with each failure in a row up to a cap (backoff.py), each failure
logged with the end of its log; the orchestrator routes to it again once it answers /health. One
member that keeps crashing never stops the cluster: the others serve on, and the orchestrator answers
503 with Retry-After for a role with no live instance.

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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from pdserve.host import die_with_parent, write_private
from pdserve.launch.backoff import RestartBackoff
from pdserve.launch.config import ClusterConfig, InstanceConfig, checked_cluster_config, instances, model_name, \
    too_big_for_memory, unsplittable_models, unusable_cores, worker_configs


class ManagedProcess:
    """One process group of the cluster (an instance or the orchestrator) and its log, which the supervisor
    starts, restarts and stops."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, health_url: str, cpus: list[int] | None,
                 backoff: RestartBackoff):
        self.name, self.log_path, self.health_url = name, log_path, health_url
        self.cmd, self.cpus = cmd, cpus
        self.backoff = backoff
        self.restart_at: float | None = None  # monotonic time of the restart due, while the member is down
        self.proc = self._spawn("wb")

    def _spawn(self, mode: str) -> subprocess.Popen:
        log = open(self.log_path, mode)
        cpus = self.cpus

        def prepare() -> None:  # in the child: stop with launch, even a launch killed -9; its cores
            die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.started = time.monotonic()
        try:
            return subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=prepare)
        finally:
            log.close()

    def restart(self) -> None:
        """Start the member again; its log goes on in the same file."""
        self.restart_at = None
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


class LocalSupervisor:
    """Every process of one cluster on this host: started, watched, restarted and stopped together."""

    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="pdserve-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.token_path = self.log_dir / "cluster_token"
        self.members: list[ManagedProcess] = []

    def _worker(self, role: str, index: int, spec: InstanceConfig, conf: dict) -> ManagedProcess:
        path = self.log_dir / f"{role}{index}.yaml"
        write_private(path, yaml.safe_dump({k: v for k, v in conf.items() if v is not None}))
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--config", str(path)]
        return ManagedProcess(f"{role}{index}", cmd, self.log_dir / f"{role}{index}.log",
                              f"http://{self.cfg.host}:{spec.port}/health", spec.cpus, self._backoff())

    def _backoff(self) -> RestartBackoff:
        return RestartBackoff(self.cfg.restart_backoff_s, self.cfg.max_restarts, self.cfg.restart_reset_s)

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
        orch = ManagedProcess("orchestrator", [sys.executable, "-m", "pdserve.orchestrator.cli", "-c", str(path)],
                              self.log_dir / "orchestrator.log", f"http://{cfg.host}:{cfg.port}/health", None,
                              self._backoff())
        self.members.append(orch)
        self._wait_healthy([orch])

    def _wait_healthy(self, members: list[ManagedProcess]) -> None:
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

    def watch(self, stop_requested) -> None:
        """Block until a stop is requested, restarting each member that dies after its backoff. Members are
        waited for side by side: one in a long backoff holds up no other's restart."""
        while not stop_requested():
            now = time.monotonic()
            for m in self.members:
                if m.restart_at is None and m.proc.poll() is not None:
                    self._failed(m, now)
                elif m.restart_at is not None and now >= m.restart_at:
                    m.restart()
                    print(f"pdserve launch: {m.name} restarted (pid {m.proc.pid})", flush=True)
            time.sleep(0.1)

    def _failed(self, m: ManagedProcess, now: float) -> None:
        wait = m.backoff.failed(uptime_s=now - m.started)
        m.restart_at = now + wait
        b = m.backoff
        print(f"pdserve launch: {m.name} exited with code {m.proc.returncode} after {now - m.started:.1f} s "
              f"(failure {b.total}, {b.in_a_row} in a row); restarting it in {wait:g} s (the wait doubles with "
              f"each failure in a row, up to {b.cap_s:g} s). End of {m.log_path}:\n{m.log_tail()}",
              file=sys.stderr, flush=True)

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


def launch(path: str | None, overrides: dict | None = None) -> int:
    """Entry point of `pdserve launch`; returns the exit code. `overrides`: cluster keys the command line set."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # health probes are not news
    cfg = checked_cluster_config(path, overrides)
    if cfg is None:
        return 1
    why = unusable_cores(cfg) or unsplittable_models(cfg) or too_big_for_memory(cfg)
    if why is not None:
        print(f"pdserve launch: error: {why}", file=sys.stderr)
        return 1
    cluster = LocalSupervisor(cfg)
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
              f"    -d '{{\"model\": \"{model_name(cfg)}\", \"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"What is the capital of France?\"}}], \"temperature\": 0, \"max_tokens\": 64}}'\n",
              flush=True)
        cluster.watch(lambda: stop["now"])
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


