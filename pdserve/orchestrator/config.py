"""The orchestrator's one checked configuration (`pdserve disaggregated -c disagg.yaml`).

Every key is documented in docs/orchestrator.md. Invalid values are a ValueError naming the key and
the fix (pydantic validation, re-worded by `load_disagg_config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.config import load_yaml, server_url
from pdserve.tls import check_tls_files

RouterType = Literal["round_robin", "load_balancing", "kv_cache_aware", "conversation"]

# Options each router accepts, with their defaults; anything else is refused by name.
ROUTER_OPTIONS: dict[str, dict[str, Any]] = {
    "round_robin": {},
    "load_balancing": {"metric": "requests"},  # requests | tokens (in-flight prompt tokens)
    "kv_cache_aware": {"load_weight": 1.0},  # score = matched blocks - load_weight * in-flight requests
    "conversation": {"prefix_messages": 2, "prefix_chars": 256, "max_sessions": 100_000},
}
MAX_FLEET_WORKERS = 64  # the snowflake id has 6 process bits


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: RouterType = "round_robin"
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_options(self) -> "RouterConfig":
        allowed = ROUTER_OPTIONS[self.type]
        unknown = sorted(set(self.options) - set(allowed))
        if unknown:
            names = ", ".join(allowed) or "none"
            raise ValueError(f"router '{self.type}' has no option {unknown[0]!r} (its options: {names})")
        metric = self.options.get("metric", "requests")
        if self.type == "load_balancing" and metric not in ("requests", "tokens"):
            raise ValueError(f"load_balancing option 'metric' must be 'requests' or 'tokens', got {metric!r}")
        for key in ("prefix_messages", "prefix_chars", "max_sessions"):
            value = self.options.get(key, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"conversation option {key!r} must be a positive integer, got {value!r}")
        weight = self.options.get("load_weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight < 0:
            raise ValueError(f"kv_cache_aware option 'load_weight' must be a number >= 0, got {weight!r}")
        return self

    def option(self, key: str) -> Any:
        return self.options.get(key, ROUTER_OPTIONS[self.type][key])


class ServerGroup(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    urls: list[str] = Field(default_factory=list, description="http://host:port of each instance; more may join "
                                                              "(pdserve serve --join)")
    router: RouterConfig = Field(default_factory=RouterConfig)
    minimal_instances: int = Field(1, ge=0, description="ready instances the orchestrator's /health waits for; "
                                                        "context_servers: 0 serves aggregated (each request whole on "
                                                        "a generation instance) while no context instance is ready")

    @field_validator("urls")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        out = [server_url(url) for url in urls]
        dupes = sorted({u for u in out if out.count(u) > 1})
        if dupes:
            raise ValueError(f"server url {dupes[0]} is listed twice")
        return out


class ConditionalDisagg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_local_prefill_length: int = Field(
        ge=0, description="uncached prompt tokens a generation instance prefills itself")


class DisaggConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    hostname: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    context_servers: ServerGroup = Field(default_factory=ServerGroup)
    generation_servers: ServerGroup = Field(default_factory=ServerGroup)
    schedule_style: Literal["context_first", "generation_first"] = "context_first"
    conditional_disagg: ConditionalDisagg | None = None
    num_workers: int = Field(1, ge=1, le=MAX_FLEET_WORKERS)
    disagg_coordinator_url: str | None = Field(None, description="external coordinator; default: own one on port-1")
    node_id: int | None = Field(None, ge=0, le=255, description="snowflake node id; default: hash of the MAC mod 256")
    server_start_timeout: float = Field(180.0, gt=0, description="s to wait for the coordinator / first ready worker")
    request_timeout: float = Field(180.0, gt=0, description="s a worker may take to answer one request")
    health_check_interval: float = Field(2.0, gt=0, description="s between /health probes of each worker")
    max_retries: int = Field(1, ge=0, description="other instances tried when one cannot be reached or is lost "
                                                 "before its answer began; with migrate_streams, also how many times "
                                                 "one stream may move")
    migrate_streams: bool = Field(True, description="a stream whose generation instance is lost after its first "
                                                    "byte goes on from another instance (its output so far "
                                                    "recomputed there); false: the client gets an error event")
    lease_ttl_s: float = Field(10.0, gt=0, description="s a joined instance stays a member without a heartbeat "
                                                       "(it heartbeats every lease_ttl_s / 3)")
    cluster_storage: str | None = Field(None, description="where joined instances are kept: unset for this "
                                                          "orchestrator's memory, or etcd://host:port[,...][/prefix]")
    api_key: str | None = Field(None, description="when set, /v1/* requires 'Authorization: Bearer <key>'")
    max_request_body_mb: float = Field(32.0, gt=0, description="a request body over this many MiB is refused (413) "
                                                               "before it is read into memory")
    client_read_timeout_s: float = Field(30.0, gt=0, description="a client has this long to send a request's headers "
                                                                 "(else 408 and the connection closes), and may pause "
                                                                 "this long at most between parts of its body")
    cluster_token: str | None = Field(None, description="when set, internal endpoints require 'X-Cluster-Token'")
    worker_api_key: str | None = Field(None, description="sent to every worker as 'Authorization: Bearer <key>' "
                                                         "(the workers' own api_key)")
    ssl_certfile: str | None = Field(None, description="serve https with this certificate (PEM); needs ssl_keyfile")
    ssl_keyfile: str | None = Field(None, description="the private key (PEM) of ssl_certfile")
    ssl_ca_file: str | None = Field(None, description="the CA certificates (PEM) trusted for https workers; "
                                                      "default: the system's")

    @field_validator("cluster_storage")
    @classmethod
    def _check_storage(cls, url: str | None) -> str | None:
        if url is not None:
            from pdserve.orchestrator.etcd_store import parse_etcd_url

            parse_etcd_url(url)
        return url

    @model_validator(mode="after")
    def _check(self) -> "DisaggConfig":
        check_tls_files(self.ssl_keyfile, self.ssl_certfile, self.ssl_ca_file)
        if self.cluster_storage is not None and self.disagg_coordinator_url is not None:
            raise ValueError("with cluster_storage (etcd) every orchestrator process reads the membership itself and "
                             "there is no coordinator: drop disagg_coordinator_url")
        if self.uses_coordinator and self.disagg_coordinator_url is None and self.port < 2:
            raise ValueError("the fleet's coordinator listens on port-1; "
                             "choose port >= 2 or set disagg_coordinator_url")
        local = {self.hostname, "127.0.0.1", "localhost", "0.0.0.0"}
        for url in (*self.context_servers.urls, *self.generation_servers.urls):
            parts = urlsplit(url)
            if parts.port == self.port and parts.hostname in local:
                raise ValueError(f"server url {url} is this orchestrator's own address (port {self.port}); list the "
                                 "workers' urls")
        if self.disagg_coordinator_url is not None:
            parts = urlsplit(self.disagg_coordinator_url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
                raise ValueError(f"disagg_coordinator_url {self.disagg_coordinator_url!r} "
                                 "must look like http://host:port")
        return self

    @property
    def coordinator_url(self) -> str:
        if self.disagg_coordinator_url is not None:
            return self.disagg_coordinator_url.rstrip("/")
        return f"http://{self.hostname}:{self.port - 1}"

    @property
    def minimal_instances(self) -> dict[str, int]:
        """Ready instances per role that /health waits for."""
        return {"context": self.context_servers.minimal_instances,
                "generation": self.generation_servers.minimal_instances}

    @property
    def uses_coordinator(self) -> bool:
        """A fleet keeps its routing state in one coordinator, unless the membership is in etcd: then each
        process routes on its own (load counts are per process)."""
        if self.cluster_storage is not None:
            return False
        return self.num_workers > 1 or self.disagg_coordinator_url is not None


def load_disagg_config(path: str | Path | None, **overrides) -> DisaggConfig:
    """disagg.yaml plus CLI overrides (None = not given), validated."""
    return load_yaml(path, DisaggConfig, **overrides)
