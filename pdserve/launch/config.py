"""The cluster config of `pdserve launch` (cluster.yaml: docs/launch.md) and the worker config of each of
its instances, checked before anything starts."""

from __future__ import annotations

import os
import secrets
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.config import WorkerConfig, load_yaml


# The longest restart wait a config may ask for: a member back later than that leaves its cluster short for too long.
MAX_RESTART_WAIT_S = 300.0


class InstanceConfig(BaseModel):
    """One instance of the cluster: its port, its cores and its worker config."""

    model_config = ConfigDict(extra="forbid")

    port: int | None = Field(None, ge=1, le=65535, description="default: orchestrator port + 1, + 2, ...")
    cpus: list[int] | None = Field(None, description="pin the instance's processes to these CPU cores")
    config: dict[str, Any] = Field(default_factory=dict, description="worker keys (docs/configuration.md)")


class RayOptions(BaseModel):
    """`pdserve launch --ray` only (ray_cluster.py)."""

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
    context: list[InstanceConfig] = Field(default_factory=lambda: [InstanceConfig()],
                                        description="[]: aggregated, the generation instances serve whole requests")
    generation: list[InstanceConfig] = Field(default_factory=lambda: [InstanceConfig()], min_length=1)
    orchestrator: dict[str, Any] = Field(default_factory=dict, description="extra disagg.yaml keys (routers, ...)")
    restart_backoff_s: float = Field(1.0, ge=0, description="wait before restarting a member that died; doubles at "
                                                            "each failure in a row, max_restarts times at most")
    max_restarts: int = Field(5, ge=0, description="failures in a row after which a member's restart wait stops "
                                                   "doubling (restart_backoff_s * 2^max_restarts); a member is "
                                                   "restarted as often as it dies, the cluster never stops for it")
    restart_reset_s: float = Field(60.0, gt=0, description="a member that ran this long before it died is restarted "
                                                           "after restart_backoff_s again")
    ray: RayOptions = Field(default_factory=RayOptions, description="placement on a Ray cluster (--ray)")
    cluster_token: str | None = Field(
        None, min_length=1, repr=False,
        description="the cluster's secret, given to every member; default: the orchestrator's or an instance's "
                    "cluster_token if the file sets one, else a new random one")

    @model_validator(mode="after")
    def _backoff_cap(self) -> "ClusterConfig":
        cap = self.restart_backoff_s * 2 ** self.max_restarts
        if cap > MAX_RESTART_WAIT_S:
            raise ValueError(f"max_restarts {self.max_restarts} with restart_backoff_s {self.restart_backoff_s:g} "
                             f"would wait up to {cap:g} s before restarting a member; max_restarts is the number of "
                             "times the wait doubles (a member is restarted as often as it dies): lower it so that "
                             f"restart_backoff_s * 2^max_restarts <= {MAX_RESTART_WAIT_S:g}")
        return self

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


def instances(cfg: ClusterConfig) -> list[tuple[str, int, InstanceConfig]]:
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


def load_cluster_config(path: str | None, overrides: dict | None = None) -> ClusterConfig:
    return load_yaml(path, ClusterConfig, **(overrides or {}))


def checked_cluster_config(path: str | None, overrides: dict | None = None) -> ClusterConfig | None:
    """The cluster config (`overrides`: keys set over the file's or the default's) with every instance's worker
    config validated, or None after saying what is wrong."""
    try:
        cfg = load_cluster_config(path, overrides)
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
    from pdserve.models import config_memo
    from pdserve.models.config import ModelConfig
    from pdserve.weights import read_config, resolve_model

    for (role, i, _), conf in zip(instances(cfg), worker_configs(cfg)):
        try:
            model_dir = resolve_model(conf.get("model"), cache_dir=conf.get("cache_dir"))
            model = ModelConfig.from_hf(read_config(model_dir), remember_in=config_memo.default_dir())
        except (ValueError, OSError) as e:
            return f"{role}{i}: {e}"
        why = model.layout_problem(int(conf.get("tensor_parallel_size", 1)), int(conf.get("pipeline_parallel_size", 1)))
        if why is not None:
            return f"{role}{i}: {why}"
    return None


@lru_cache(maxsize=16)
def _model_config(model: str | None, cache_dir: str | None):
    """The ModelConfig of an instance's model (`pdserve plan` asks for each of its candidates' instances)."""
    from pdserve.models import config_memo
    from pdserve.models.config import ModelConfig
    from pdserve.weights import read_config, resolve_model

    return ModelConfig.from_hf(read_config(resolve_model(model, cache_dir=cache_dir)),
                               remember_in=config_memo.default_dir())


def too_big_for_memory(cfg: ClusterConfig, available: int | None = None) -> str | None:
    """Why the instances that will run on this host's CPU need more memory together than it has (`available`
    bytes; default MemAvailable), or None. Each instance checks its own footprint again when it starts
    (engine/footprint.py), but alone: only here are the instances that share the host added up, before any
    of them loads a weight. An instance on CUDA checks its devices itself."""
    from pdserve.engine.footprint import GIB, available_bytes, footprint
    from pdserve.engine.worker import pick_device

    needs = []
    for (role, i, _), conf in zip(instances(cfg), worker_configs(cfg)):
        wcfg = load_yaml(None, WorkerConfig, **conf)
        if pick_device(wcfg, 0).type != "cpu":
            continue
        model = _model_config(wcfg.model, wcfg.cache_dir)
        needs.append((f"{role}{i}", footprint(model, wcfg, "cpu", wcfg.max_model_len or model.max_position_embeddings)))
    available = available_bytes("cpu") if available is None else available
    total = sum(fp.total for _, fp in needs)
    if len(needs) < 2 or total <= available:
        return None  # one instance alone is the instance's own check, with its own memory_limit_gb
    each = ", ".join(f"{name} {fp.total / GIB:.2f} GiB ({len(fp.ranks)} rank(s): weights "
                     f"{sum(r.weights + r.cpu_copies for r in fp.ranks) / GIB:.2f}, KV pool "
                     f"{sum(r.kv_pool for r in fp.ranks) / GIB:.2f})" for name, fp in needs)
    return (f"the instances on this host's CPU need {total / GIB:.2f} GiB together before any request ({each}), and "
            f"it has {available / GIB:.2f} GiB available: start fewer instances, lower their kv_cache_memory_gb, "
            "serve in bfloat16, or set the generation instances' cpu_decode_gemv: false")


def model_name(cfg: ClusterConfig) -> str:
    conf = cfg.generation[0].config
    if conf.get("served_model_name"):
        return conf["served_model_name"]
    model = conf.get("model", cfg.model)
    if model is None:
        return "SmolLM2-135M-Instruct"
    return Path(model).stem if model.endswith(".gguf") else Path(model).name
