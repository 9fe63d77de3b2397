"""`pdserve disaggregated -c disagg.yaml`: the orchestrator, alone or as a fleet with its coordinator.

    num_workers == 1, no disagg_coordinator_url   one process: routing state lives in it
    num_workers == 1, disagg_coordinator_url      one stateless process using that coordinator
    num_workers > 1                               a supervisor starts the coordinator on port-1 (unless
                                                  disagg_coordinator_url names one) and N orchestrator
                                                  processes sharing the port (SO_REUSEPORT); if any child
                                                  exits, the rest are stopped and its exit code returned
    num_workers > 1, cluster_storage: etcd://     the same, with no coordinator: each process reads the
                                                  membership from etcd and routes on its own

Children are this module run with --internal-role; they read the validated config from the
environment variable PDSERVE_DISAGG_CONFIG (JSON), not from argv, so the API key stays out of `ps`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from urllib.parse import urlsplit

from pdserve import tls
from pdserve.env import DISAGG_CONFIG, for_child, settings
from pdserve.orchestrator.config import DisaggConfig, load_disagg_config

log = logging.getLogger("pdserve.orchestrator")

_CHILD_STOP_S = 10.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve disaggregated", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", default=None, help="disagg.yaml (see docs/orchestrator.md)")
    p.add_argument("--host", default=None, help="bind address (overrides hostname)")
    p.add_argument("--port", type=int, default=None, help="public port (overrides port)")
    p.add_argument("--num-workers", type=int, default=None, help="orchestrator processes (overrides num_workers)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument("--internal-role", choices=["coordinator", "worker"], help=argparse.SUPPRESS)
    p.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    return p


def main_disaggregated(argv: list[str] | None = None) -> int:
    """Entry point of `pdserve disaggregated`; returns the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.internal_role is not None:
            cfg = DisaggConfig.model_validate_json(_handed_config())
        else:
            if args.config is None:
                raise ValueError("pdserve disaggregated needs a config: -c disagg.yaml (see docs/orchestrator.md)")
            cfg = load_disagg_config(args.config, hostname=args.host, port=args.port, num_workers=args.num_workers,
                                     api_key=args.api_key)
        if args.internal_role == "coordinator":
            return _run_coordinator(cfg)
        if args.internal_role == "worker":
            return _run_worker(cfg, args.worker_index, reuse_port=True)
        if cfg.num_workers == 1:
            return _run_worker(cfg, 0, reuse_port=False)
        return _run_fleet(cfg, args.log_level)
    except ValueError as e:
        print(f"pdserve disaggregated: error: {e}", file=sys.stderr)
        return 2


def _handed_config() -> str:
    """The fleet supervisor's validated config, which a child of the fleet gets in its environment."""
    handed = settings().disagg_config
    if handed is None:
        raise ValueError(f"--internal-role is for the processes of a fleet, started with {DISAGG_CONFIG} set; "
                         "start the orchestrator with -c disagg.yaml")
    return handed


def _run_coordinator(cfg: DisaggConfig) -> int:
    from pdserve.orchestrator.app import bind_socket, run_app
    from pdserve.orchestrator.coordinator import build_coordinator_app

    parts = urlsplit(cfg.coordinator_url)
    sock = bind_socket(parts.hostname, parts.port, reuse_port=False)
    log.info("coordinator on %s", cfg.coordinator_url)
    run_app(build_coordinator_app(cfg), sock, cfg.client_read_timeout_s)
    return 0


def _run_worker(cfg: DisaggConfig, index: int, reuse_port: bool) -> int:
    from pdserve.orchestrator.app import bind_socket, build_app, run_app
    from pdserve.orchestrator.coordinator import CoordinatorUnreachable, RemoteCluster, wait_for_coordinator

    cluster = None
    if cfg.cluster_storage is not None:
        from pdserve.orchestrator.etcd_store import wait_for_etcd
        from pdserve.orchestrator.membership import StoreUnavailable

        try:
            wait_for_etcd(cfg.cluster_storage, cfg.server_start_timeout)
        except StoreUnavailable as e:
            print(f"pdserve disaggregated: orchestrator {index}: error: {e}", file=sys.stderr)
            return 1
    if cfg.uses_coordinator:
        try:
            wait_for_coordinator(cfg.coordinator_url, cfg.server_start_timeout, cfg.cluster_token)
        except CoordinatorUnreachable as e:
            print(f"pdserve disaggregated: orchestrator {index}: error: {e}", file=sys.stderr)
            return 1
        cluster = RemoteCluster(cfg, cfg.coordinator_url)
    sock = bind_socket(cfg.hostname, cfg.port, reuse_port=reuse_port)
    log.info("orchestrator %d (pid %d) on %s://%s:%d", index, os.getpid(), tls.scheme(cfg.ssl_certfile), cfg.hostname,
             cfg.port)
    run_app(build_app(cfg, process_id=index, cluster=cluster), sock, cfg.client_read_timeout_s,
            ssl=tls.uvicorn_ssl(cfg.ssl_keyfile, cfg.ssl_certfile))
    return 0


def _run_fleet(cfg: DisaggConfig, log_level: str) -> int:
    env = for_child({DISAGG_CONFIG: cfg.model_dump_json()})
    base = [sys.executable, "-m", "pdserve.orchestrator.cli", "--log-level", log_level, "--internal-role"]
    own_coordinator = cfg.uses_coordinator and cfg.disagg_coordinator_url is None
    roles = ([["coordinator"]] if own_coordinator else []) + [
        ["worker", "--worker-index", str(i)] for i in range(cfg.num_workers)]
    children: list[subprocess.Popen] = []
    stop: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _f: stop.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for role in roles:
            children.append(subprocess.Popen(base + role, env=env))
        log.info("fleet: %d orchestrator processes on %s://%s:%d, %s", cfg.num_workers, tls.scheme(cfg.ssl_certfile),
                 cfg.hostname, cfg.port,
                 f"coordinator {cfg.coordinator_url}" if cfg.uses_coordinator else f"members in {cfg.cluster_storage}")
        while not stop:
            done = [c for c in children if c.poll() is not None]
            if done:
                code = done[0].returncode
                print(f"pdserve disaggregated: a fleet process ({' '.join(done[0].args[-3:])}) exited with "
                      f"code {code}; stopping the others", file=sys.stderr)
                return code if code != 0 else 1
            time.sleep(0.1)
        return 0
    finally:
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _CHILD_STOP_S
        for c in children:
            try:
                c.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait(timeout=5)
        for s, h in previous.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main_disaggregated())
