"""`pdserve launch --ray [ADDRESS] cluster.yaml`: the cluster of `pdserve launch` on a Ray cluster, and
`pdserve scale ROLE N`, which resizes it while it serves.

    pdserve launch --ray ──> Controller actor "pdserve-controller" (namespace "pdserve", on the head node)
                               ├─ an orchestrator actor (head node) running `pdserve disaggregated`
                               └─ per instance: a placement group, one bundle per rank ({CPU: cpus_per_rank,
                                  GPU: gpus_per_rank}, STRICT_PACK: all on one node), and an actor in it
                                  running `pdserve serve --join ORCHESTRATOR --role R`
    pdserve scale ROLE N ──> the controller starts instances of ROLE, or drains the newest ones
                             (SIGTERM: the instance leaves the cluster, finishes its requests, exits)

Instances join the orchestrator by themselves (docs/deploy.md), so the orchestrator's config lists
none and a new or restarted instance is routed to as soon as it serves. Ray's own failure handling is
used: an actor that dies (its process killed, or its server exited, which ends the actor) is restarted
by Ray as often as it dies (max_restarts=-1), and starts its server again, which joins again. Ray
restarts an actor at once, so the restarted actor waits before it starts its server, as long as
`pdserve launch` would (backoff.py); its failures in a row are kept in a file beside its log, on its
node (an instance's placement group keeps it there). The server runs as a child of its actor and dies
with it (PR_SET_PDEATHSIG), so a killed actor leaves nothing behind.

Ray must be installed on every node (`pip install 'pdserve[ray]'`), with pdserve and the model at the
same paths. An instance's ranks are processes of its own host (pdserve starts them), hence one node
per instance; KV between instances on different nodes needs `backend: nixl` (an shm pair across hosts
is refused when it joins).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdserve.host import die_with_parent, write_private
from pdserve.launch.backoff import RestartBackoff
from pdserve.launch.config import ClusterConfig, checked_cluster_config, worker_configs

NAMESPACE = "pdserve"
CONTROLLER = "pdserve-controller"
ROLES = ("context", "generation")
_HEAD_RESOURCE = "node:__internal_head__"
_DRAIN_S = 60.0
_STATUS_WAIT_S = 30.0  # how long status waits for an actor that Ray is restarting


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends it SIGKILL when its parent (the actor) dies."""
    die_with_parent(signal.SIGKILL)


class ServerProcess:
    """A Ray actor that runs one pdserve server process and lives exactly as long as it does (once a
    restarted actor's backoff is over)."""

    def __init__(self, name: str, argv: list[str], conf: dict, conf_flag: str, log_dir: str,
                 backoff: tuple[float, int, float], port: int | None = None):
        import ray

        from pdserve.host import free_port

        self.ip = ray.util.get_node_ip_address()
        self.port = port or free_port(self.ip)
        self.name, self.node_id = name, ray.get_runtime_context().get_node_id()
        conf = {**conf, "port": self.port}
        if "hostname" in conf:  # the orchestrator's key
            conf["hostname"] = self.ip
        else:
            conf.update(host=self.ip, advertise_url=f"http://{self.ip}:{self.port}")
        directory = Path(log_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{name}-{self.port}.yaml"  # holds the cluster token: 0600, not on the command line
        write_private(path, yaml.safe_dump({k: v for k, v in conf.items() if v is not None}))
        self.log_path = directory / f"{name}-{self.port}.log"
        self._cmd = [sys.executable, "-m", *argv, conf_flag, str(path)]
        self.proc: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # start and stop of the server, which may race while the actor waits
        reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
        failures = RestartBackoff(*backoff)
        self.wait_s = _restart_wait(directory / f"{name}.restarts.json", failures, reconstructed)
        with open(self.log_path, "wb") as log:  # a new file: each start takes a new port
            if reconstructed:
                log.write(f"pdserve launch --ray: {name} was restarted by Ray (failure {failures.total}, "
                          f"{failures.in_a_row} in a row); its server starts in {self.wait_s:g} s\n".encode())
        if not self.wait_s:
            self._start_server()
        threading.Thread(target=self._serve, daemon=True).start()

    def _start_server(self) -> bool:
        with self._lock:
            if self._stopping.is_set():
                return False
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT,
                                             preexec_fn=_die_with_parent)
            return True

    def _serve(self) -> None:
        """Start the server once the backoff is over (unless it runs already), then end the actor when the
        server dies, so that Ray restarts both."""
        if self.proc is None and (self._stopping.wait(self.wait_s) or not self._start_server()):
            return
        self.proc.wait()
        if not self._stopping.is_set():
            os._exit(1)

    def info(self) -> dict[str, Any]:
        """server_pid is None while a restarted actor waits out its backoff."""
        return {"name": self.name, "url": f"http://{self.ip}:{self.port}", "node_id": self.node_id,
                "actor_pid": os.getpid(), "server_pid": self.proc.pid if self.proc else None,
                "starts_in_s": self.wait_s, "log": str(self.log_path)}

    def stop(self, timeout_s: float = _DRAIN_S) -> int:
        """SIGTERM (a worker drains and leaves), SIGKILL after timeout_s; the exit code (0: no server had
        started)."""
        with self._lock:
            self._stopping.set()
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


def _restart_wait(state: Path, backoff: RestartBackoff, reconstructed: bool) -> float:
    """Seconds an actor waits before it starts its server: 0 at its first start, else its backoff after one
    more failure, counted in `state` (JSON on the actor's node). A state that is missing or unreadable (the
    actor was placed on another node) starts the count over."""
    now = time.time()  # wall time: the state outlives the process
    wait = 0.0
    if reconstructed:
        try:
            last = json.loads(state.read_text())
            backoff.in_a_row, backoff.total = int(last["in_a_row"]), int(last["total"])
            uptime = now - float(last["started"])
        except (OSError, ValueError, KeyError, TypeError):
            uptime = 0.0
        wait = backoff.failed(uptime)
    state.write_text(json.dumps({"in_a_row": backoff.in_a_row, "total": backoff.total, "started": now + wait}))
    return wait


class Controller:
    """The Ray actor that owns the cluster: the orchestrator actor, and per role its instances."""

    def __init__(self, cfg_json: str, log_dir: str):
        self.cfg = ClusterConfig.model_validate_json(cfg_json)
        self.log_dir = log_dir
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        write_private(Path(log_dir) / "cluster_token", self.cfg.cluster_token + "\n")  # for members joined by hand
        confs = worker_configs(self.cfg)
        specs = self.cfg.context + self.cfg.generation
        for spec, conf in zip(specs, confs):  # threads: what Ray reserves for a rank, not this host's cores
            if "num_threads" not in spec.config:
                conf["num_threads"] = max(1, int(self.cfg.ray.cpus_per_rank))
        n_ctx = len(self.cfg.context)
        self.templates = {"context": confs[:n_ctx], "generation": confs[n_ctx:]}
        self.instances: dict[str, list[tuple[Any, Any]]] = {role: [] for role in ROLES}  # (actor, placement group)
        self.orchestrator = None
        self.url: str | None = None
        self._started = {role: 0 for role in ROLES}
        self._backoff = (self.cfg.restart_backoff_s, self.cfg.max_restarts, self.cfg.restart_reset_s)

    def start(self) -> str:
        """Start the orchestrator, then every instance of the YAML, and wait until the orchestrator routes
        to all of them; the orchestrator's url."""
        import ray

        cfg = self.cfg
        disagg = {**cfg.orchestrator, "hostname": cfg.host}
        self.orchestrator = _server_actor(num_cpus=0, head=True).remote(
            "orchestrator", ["pdserve.orchestrator.cli"], disagg, "-c", self.log_dir, self._backoff, cfg.port)
        info = ray.get(self.orchestrator.info.remote())
        self.url = info["url"]
        for role in ROLES:
            for conf in self.templates[role]:
                self._add(role, conf)
        for role in ROLES:
            self._wait_routed(role)
        return self.url

    def _add(self, role: str, conf: dict) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        ray_opts = self.cfg.ray
        ranks = int(conf.get("tensor_parallel_size", 1)) * int(conf.get("pipeline_parallel_size", 1))
        bundle = {"CPU": ray_opts.cpus_per_rank, **({"GPU": ray_opts.gpus_per_rank} if ray_opts.gpus_per_rank else {})}
        taken = sorted({node for r in ROLES for _, group in self.instances[r] for node in _nodes_of(group)})
        spread = ray_opts.placement == "spread" and taken
        # spread: only on a node that holds no instance of this cluster yet (Ray's node-id label)
        selector = [{"ray.io/node-id": f"!in({','.join(taken)})"}] * ranks if spread else None
        pg = placement_group([bundle] * ranks, strategy="STRICT_PACK", bundle_label_selector=selector)
        try:
            ray.get(pg.ready(), timeout=ray_opts.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            where = "a node that holds no other instance (ray.placement: spread)" if spread else "one node"
            raise RuntimeError(
                f"Ray has no room for a {role} instance ({ranks} rank(s) x {bundle} on {where}) within "
                f"{ray_opts.placement_timeout_s:g} s; free: {ray.available_resources()}. Add a node, or lower "
                "ray.cpus_per_rank / ray.gpus_per_rank in the cluster config") from None
        name = f"{role}{self._started[role]}"
        self._started[role] += 1
        actor = _server_actor(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), pg=pg).remote(
            name, ["pdserve.cli", "serve"], {**conf, "join": self.url, "role": role}, "--config", self.log_dir,
            self._backoff)
        self.instances[role].append((actor, pg))

    def scale(self, role: str, n: int) -> list[dict]:
        """Start or drain instances of `role` until it has n; then wait until the orchestrator routes to
        every one (at most startup_timeout). The instances of the role, as `status` lists them."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if n < 1:
            raise ValueError(f"a cluster needs at least one {role} instance; got {n}")
        while len(self.instances[role]) < n:
            self._add(role, self.templates[role][-1])
        while len(self.instances[role]) > n:
            actor, pg = self.instances[role].pop()
            ray.get(actor.stop.remote())  # drains: out of routing at once, its requests finish
            ray.kill(actor, no_restart=True)
            remove_placement_group(pg)
        self._wait_routed(role)
        return self.status()[role]

    def _wait_routed(self, role: str) -> None:
        import ray

        wanted = {ray.get(a.info.remote())["url"] for a, _ in self.instances[role]}
        keys = self.cfg.orchestrator
        headers = ({"X-Cluster-Token": keys["cluster_token"]} if keys.get("cluster_token") else
                   {"Authorization": f"Bearer {keys['api_key']}"} if keys.get("api_key") else {})
        deadline = time.monotonic() + self.cfg.startup_timeout
        while True:
            try:
                info = httpx.get(self.url + "/cluster_info", headers=headers, timeout=5, trust_env=False).json()
                ready = {i["url"] for i in info[f"{role}_servers"]["instances"] if i["ready"]}
                if ready == wanted:
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the orchestrator does not route to every {role} instance after "
                                   f"{self.cfg.startup_timeout:.0f} s; see the logs in {self.log_dir}")
            time.sleep(0.2)

    def status(self) -> dict[str, list[dict]]:
        """Every actor's info; one that Ray could not restart any more shows as {"dead": reason}."""
        import ray

        def info(actor) -> dict:
            deadline = time.monotonic() + _STATUS_WAIT_S
            while True:
                try:
                    return ray.get(actor.info.remote(), timeout=max(deadline - time.monotonic(), 0.1))
                except ray.exceptions.ActorUnavailableError as e:  # restarting, or not known to be back yet
                    if time.monotonic() > deadline:
                        return {"dead": f"unavailable for {_STATUS_WAIT_S:g} s: {str(e).splitlines()[0]}"}
                    time.sleep(0.2)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                    return {"dead": f"{type(e).__name__}: {str(e).splitlines()[0]}"}

        out = {role: [info(a) for a, _ in self.instances[role]] for role in ROLES}
        out["orchestrator"] = [info(self.orchestrator)] if self.orchestrator is not None else []
        return out

    def shutdown(self) -> None:
        """Drain every instance, then stop the orchestrator."""
        import ray
        from ray.util.placement_group import remove_placement_group

        actors = [(a, pg) for role in ROLES for a, pg in self.instances[role]]
        stops = [a.stop.remote() for a, _ in actors]
        for ref in stops:
            try:
                ray.get(ref, timeout=_DRAIN_S + 15)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
        if self.orchestrator is not None:
            try:
                ray.get(self.orchestrator.stop.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
        for a, pg in actors:
            ray.kill(a, no_restart=True)
            remove_placement_group(pg)
        if self.orchestrator is not None:
            ray.kill(self.orchestrator, no_restart=True)


def _nodes_of(group) -> set[str]:
    """The nodes a placement group's bundles were placed on."""
    from ray.util.placement_group import placement_group_table

    return {node for node in placement_group_table(group).get("bundles_to_node_id", {}).values() if node}


def _server_actor(num_cpus: float, num_gpus: float = 0, head: bool = False, pg=None):
    """A server actor's class: Ray restarts it as often as it dies (-1); it waits out its backoff itself."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    if pg is not None:
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    else:
        strategy = NodeAffinitySchedulingStrategy(_head_node_id(), soft=False) if head else None
    return ray.remote(ServerProcess).options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=-1,
                                             max_task_retries=0, scheduling_strategy=strategy)


def _head_node_id() -> str:
    import ray

    for node in ray.nodes():
        if node["Alive"] and _HEAD_RESOURCE in node["Resources"]:
            return node["NodeID"]
    raise RuntimeError("the Ray cluster has no live head node")


def check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """ConnectionError where nothing answers at a `--ray HOST:PORT` address. ray.init retries such an
    address for minutes before it gives up; one TCP connect says so in seconds."""
    if address in (None, "auto"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # not HOST:PORT: ray.init judges it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at {address}: {e}") from None


def _connect(address: str | None) -> None:
    import ray

    check_reachable(address)
    if address in (None, "auto"):
        try:
            ray.init(address="auto", namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
            return
        except ConnectionError:
            if address == "auto":
                raise
        # no cluster here: a one-node Ray on this machine, on loopback
        ray.init(namespace=NAMESPACE, include_dashboard=False, _node_ip_address="127.0.0.1",
                 logging_level="WARNING", log_to_driver=False)
        return
    ray.init(address=address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)


def launch_ray(path: str | None, address: str | None, overrides: dict | None = None) -> int:
    """Entry point of `pdserve launch --ray`; returns the exit code. `overrides`: cluster keys the command line set."""
    try:
        import ray
    except ImportError:
        print("pdserve launch: error: --ray needs Ray: pip install 'pdserve[ray]'", file=sys.stderr)
        return 1
    cfg = checked_cluster_config(path, overrides)
    if cfg is None:
        return 1
    log_dir = cfg.log_dir or f"/tmp/pdserve-ray-{time.strftime('%Y%m%d-%H%M%S')}"
    stop = {"now": False}

    def on_signal(signum, _frame):
        stop["now"] = True

    try:
        _connect(address)
    except ConnectionError as e:
        print(f"pdserve launch: error: cannot reach a Ray cluster ({e}); pass the head node's address "
              "(`ray start --head` prints it)", file=sys.stderr)
        return 1
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    controller = None
    try:
        if _existing_controller() is not None:
            raise RuntimeError(f"a pdserve cluster already runs on this Ray cluster ({CONTROLLER} in namespace "
                               f"{NAMESPACE}); stop its `pdserve launch --ray` first")
        controller = ray.remote(Controller).options(
            name=CONTROLLER, num_cpus=0, max_restarts=0,
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(_head_node_id(),
                                                                                             soft=False),
        ).remote(cfg.model_dump_json(), log_dir)
        print(f"pdserve launch --ray: {len(cfg.context)} context + {len(cfg.generation)} generation instance(s) "
              f"on Ray {ray.get_runtime_context().gcs_address}; logs in {log_dir} on each node; cluster token in "
              f"{log_dir}/cluster_token on the head node (mode 0600)", flush=True)
        url = ray.get(controller.start.remote())
        _print_status(ray.get(controller.status.remote()))
        print(f"\nready: OpenAI API at {url}/v1 (Ctrl-C stops everything; `pdserve scale ROLE N` resizes)\n",
              flush=True)
        while not stop["now"]:
            time.sleep(0.5)
        return 0
    except (RuntimeError, ValueError, ray.exceptions.RayError) as e:
        print(f"pdserve launch: error: {e}", file=sys.stderr)
        return 1
    finally:
        print("pdserve launch: stopping...", flush=True)
        if controller is not None:
            try:
                ray.get(controller.shutdown.remote(), timeout=_DRAIN_S + 60)
            except ray.exceptions.RayError as e:
                print(f"pdserve launch: stopping the cluster: {e}", file=sys.stderr)
            ray.kill(controller)
        ray.shutdown()
        for s, handler in previous.items():
            signal.signal(s, handler)
        print("pdserve launch: stopped.", flush=True)


def _existing_controller():
    import ray

    try:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        return None


def scale(role: str, n: int, address: str | None) -> int:
    """Entry point of `pdserve scale ROLE N`."""
    if n < 1:  # no cluster needed to say so (the controller checks again)
        print(f"pdserve scale: error: a cluster needs at least one {role} instance; got {n}", file=sys.stderr)
        return 1
    try:
        import ray
    except ImportError:
        print("pdserve scale: error: needs Ray: pip install 'pdserve[ray]'", file=sys.stderr)
        return 1
    try:
        check_reachable(address)
        ray.init(address=address or "auto", namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
    except ConnectionError as e:
        print(f"pdserve scale: error: cannot reach a Ray cluster ({e}); pass --ray ADDRESS", file=sys.stderr)
        return 1
    try:
        controller = _existing_controller()
        if controller is None:
            raise RuntimeError("no `pdserve launch --ray` runs on this Ray cluster")
        print(f"pdserve scale: {role} -> {n} ...", flush=True)
        ray.get(controller.scale.remote(role, n))
        _print_status(ray.get(controller.status.remote()))
        return 0
    except (RuntimeError, ray.exceptions.RayError) as e:
        cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None else e
        print(f"pdserve scale: error: {cause}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()


def _print_status(status: dict[str, list[dict]]) -> None:
    for role in ("orchestrator", *ROLES):
        for inst in status[role]:
            if "dead" in inst:
                print(f"  {role:<13} dead    {inst['dead']}", flush=True)
            else:
                print(f"  {inst['name']:<13} {inst['url']:<24} node {inst['node_id'][:12]}   log {inst['log']}",
                      flush=True)
