"""One checked configuration per process, built once and passed whole.

`EngineConfig` holds what the engine needs; `WorkerConfig` adds what `pdserve serve` needs. Both
validate on construction: an invalid key or value is a ValueError naming the key and the fix. Every key
is documented in docs/configuration.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdserve.kv_transfer.agents.faults import FaultPlan
from pdserve.kv_transfer.bounce import BounceConfig
from pdserve.kv_transfer.transceiver import TransceiverConfig
from pdserve.tls import check_tls_files

# How long pdserve's HTTP servers keep an idle keep-alive connection open: longer than clients keep one
# (httpx and the OpenAI client: 5 s; the orchestrator's client to its workers: the same), so that a
# client never sends a request on a connection the server is closing at that moment (uvicorn's own
# default is also 5 s, and the two racing failed requests with "Server disconnected"). nginx's default.
HTTP_KEEP_ALIVE_S = 75

# The KV exchange's defaults live in the library (kv_transfer/); the user-facing keys below take theirs
# from these, in the units the user writes, and `to_transceiver_config` is the one translation back.
_TX = TransceiverConfig()
_BOUNCE = BounceConfig()


class BounceSettings(BaseModel):
    """Gather many small KV fragments into one staging write. Both sides must use equal values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    staging_mb: int = Field(_BOUNCE.staging_bytes >> 20, ge=1, description="registered staging buffer per rank, MiB")
    min_kv_blocks: int = Field(_BOUNCE.min_kv_blocks, ge=1)
    min_fragments: int = Field(_BOUNCE.min_fragments, ge=1)
    max_mean_fragment_kb: int = Field(_BOUNCE.max_avg_fragment_bytes >> 10, ge=1)

    def to_bounce_config(self) -> BounceConfig | None:
        """The library's BounceConfig, or None when bouncing is off. min_state_bytes keeps the library's
        default: it gates state payloads, which no supported model has."""
        if not self.enabled:
            return None
        return BounceConfig(staging_bytes=self.staging_mb << 20, min_kv_blocks=self.min_kv_blocks,
                            min_fragments=self.min_fragments, max_avg_fragment_bytes=self.max_mean_fragment_kb << 10)


class CacheTransceiverConfig(BaseModel):
    """KV exchange between a context and a generation instance. No backend means disabled."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["nixl", "shm"] | None = Field(
        None, description="transfer agent; required for context_only / generation_only requests")
    kv_transfer_timeout_ms: int = Field(
        _TX.kv_transfer_timeout_ms, ge=1, description="a transfer older than this fails and frees its KV")
    rank_info_timeout_s: float = Field(
        _TX.rank_info_timeout_s, gt=0, description="first contact with a context instance")
    peer_lost_ms: int = Field(
        _TX.peer_lost_ms, ge=1,
        description="generation side: a context rank whose KV control endpoint has had no connection for this "
                    "long (killed, or cut off) fails the transfers waiting on it at once, not at "
                    "kv_transfer_timeout_ms")
    host: str = Field("127.0.0.1", description="address the KV control endpoints bind to and advertise")
    cluster_token: str | None = Field(
        None, min_length=1, repr=False,
        description="the cluster's secret, the same on every instance and as the orchestrator's cluster_token: "
                    "the KV control plane requires it (ZeroMQ CURVE), and so do requests carrying "
                    "disaggregated_params and /v1/disagg/* (X-Cluster-Token); joining proves it")
    max_control_message_mb: int = Field(
        _TX.max_control_message_bytes >> 20, ge=1,
        description="a KV control peer sending a larger message is disconnected, MiB")
    bounce: BounceSettings = BounceSettings()
    pipelined_transfer: bool = Field(
        False, description="context side: offer each prefill chunk's finished blocks as soon as it is computed "
                           "(generation_first requests; takes effect with chunked prefill)")
    nixl_progress_delay_us: int = Field(
        1000, ge=0, le=1_000_000,
        description="nixl: microseconds NIXL's progress thread waits between passes; 0 keeps NIXL's own (a "
                    "sched_yield loop that holds a core while idle and halves a one-core instance's prefill)")
    checksum: bool = Field(
        _TX.checksum,
        description="a CRC32 per KV block, computed by the context side and checked by the generation side; "
                    "a mismatch fails the transfer (the orchestrator retries it). Either side turns it on; "
                    "host memory only")
    canary: bool = Field(
        True, description="first contact with a context instance writes a known pattern through the real mapping "
                          "into blocks kept for it, and the generation side checks every byte before any request "
                          "takes KV from that instance (kv_transfer/canary.py); host memory only")
    fault_injection: FaultPlan | None = Field(
        None, description="testing only: make this instance's writes fail or start late, and lose some of the "
                          "notifications it receives (kv_transfer/agents/faults.py)")

    def to_transceiver_config(self) -> TransceiverConfig:
        """The library's TransceiverConfig for one rank (host, backend, canary, pipelining and faults are
        the engine's to apply)."""
        return TransceiverConfig(
            kv_transfer_timeout_ms=self.kv_transfer_timeout_ms, rank_info_timeout_s=self.rank_info_timeout_s,
            bounce=self.bounce.to_bounce_config(), max_control_message_bytes=self.max_control_message_mb << 20,
            cluster_token=self.cluster_token, checksum=self.checksum, peer_lost_ms=self.peer_lost_ms)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="HF directory or .gguf file; None = embedded SmolLM2-135M-Instruct")
    served_model_name: str | None = Field(
        None, description="name clients use in 'model'; default: derived from the path")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8_e4m3"] = Field(
        "auto", description="auto: the weights' dtype; fp8_e4m3: float8_e4m3fn with a static K and V scale per "
                            "layer (the checkpoint's self_attn.k_scale / v_scale, else 1.0), half a bf16 cache's "
                            "bytes (docs/configuration.md)")
    kv_layout: Literal["HND", "NHD"] = "HND"
    tokens_per_block: int = Field(32, ge=1, le=1024)
    kv_cache_memory_gb: float = Field(1.0, gt=0, description="KV pool size per rank, GiB")
    num_kv_blocks: int | None = Field(None, ge=1, description="overrides kv_cache_memory_gb when set")
    memory_limit_gb: float | None = Field(
        None, gt=0, description="the memory the weights, KV pool and recurrent state may take, GiB: on CPU all ranks "
                                "together, on CUDA each rank's device; an instance that needs more is refused at start, "
                                "before loading any weight. Default: what the machine has (MemAvailable; the device's "
                                "free memory) (engine/footprint.py)")
    max_model_len: int | None = Field(None, ge=2, description="context window; default: the model's")
    max_num_seqs: int = Field(64, ge=1, description="max requests in one batch")
    max_num_tokens: int = Field(1024, ge=1, description="token budget of one forward step")
    enable_chunked_prefill: bool = True
    tpot_slo_ms: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="when set, a step that decodes requests takes only as many prefill tokens as keep each of them "
                    "within this mean time per output token (aiming 10% under it), learning a step's cost from the "
                    "steps it runs; a prompt still moves at least one KV block a step (docs/configuration.md)")
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads per rank; default: cores / ranks")
    cpu_decode_gemv: bool = Field(
        True, description="CPU: decode steps of a few sequences run their linears through pdserve's GEMV on a "
                          "second, plain copy of every linear weight (the linear weights' memory twice), and a "
                          "one-sequence step without TP runs the whole layer stack in one native call; false "
                          "keeps oneDNN's packed copy only")
    moe_experts: Literal["sharded", "replicated"] = Field(
        "sharded", description="tensor parallelism of a MoE model's routed experts: sharded cuts every expert's "
                               "intermediate dimension over the TP ranks, each rank computing every routed token "
                               "on its slice; replicated keeps every expert whole on every rank (their memory "
                               "tp_size times), each rank computing its 1/tp_size of the step's expert-sorted "
                               "choices (docs/configuration.md)")
    cuda_graphs: bool = Field(
        True, description="CUDA, one rank: decode steps replay a CUDA graph captured once per batch size of "
                          "cuda_graph_batch_sizes (the batch padded up to the next), sampling included "
                          "(engine/static_decode.py); false runs every step eagerly")
    cuda_graph_batch_sizes: list[int] | None = Field(
        None, description="the batch sizes decode graphs are captured for; default 1, 2, 4, 8, then every "
                          "multiple of 8 up to max_num_seqs (at most 256). A larger decode batch runs eagerly")
    static_decode_on_cpu: bool = Field(
        False, description="CPU: run decode steps through the padded, host-sync-free step that CUDA captures as "
                           "graphs, eagerly; for checking that step against the eager one, not for speed")
    dist_host: str = Field("127.0.0.1", description="address of rank 0's torch.distributed store")
    dist_port: int = Field(0, ge=0, le=65535, description="0 = pick a free port")
    dist_timeout_s: float = Field(300.0, gt=0, description="rank start-up and collective timeout")
    cache_dir: str | None = Field(None, description="where converted GGUF models are cached; default "
                                                     "$PDSERVE_CACHE_DIR/converted (~/.cache/pdserve/converted)")
    seed: int = 0
    generation_config: Literal["auto", "none"] = Field(
        "auto", description="auto: a request that leaves temperature, top_p, top_k, min_p, repetition_penalty or "
                            "max_tokens out gets the value the checkpoint's generation_config.json recommends "
                            "(as vLLM does); none: OpenAI's defaults")
    instance_name: str | None = Field(None, description="this instance's name towards KV peers; default: random")
    cache_transceiver_config: CacheTransceiverConfig = CacheTransceiverConfig()

    @field_validator("cuda_graph_batch_sizes")
    @classmethod
    def _check_graph_sizes(cls, sizes: list[int] | None) -> list[int] | None:
        if sizes is not None and (not sizes or any(n < 1 or n > 1024 for n in sizes)):
            raise ValueError(f"cuda_graph_batch_sizes must be a non-empty list of batch sizes in [1, 1024], "
                             f"got {sizes}")
        return None if sizes is None else sorted(set(sizes))

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if not self.enable_chunked_prefill and self.max_model_len and self.max_num_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_tokens={self.max_num_tokens} < max_model_len={self.max_model_len} needs "
                "enable_chunked_prefill: true (or raise max_num_tokens)")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def server_url(url: str) -> str:
    """An instance's url in one spelling, http://host:port; ValueError saying what is wrong."""
    if not isinstance(url, str):
        raise ValueError(f"server url must be a string like http://host:port, got {url!r}")
    if "://" not in url:
        url = "http://" + url  # 'host:port' as TensorRT-LLM's configs write it
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(f"server url {url!r:.300} must look like http://host:port")
    if len(parts.hostname) > 253:  # the longest DNS name
        raise ValueError(f"server url {url!r:.300} has a host name of {len(parts.hostname)} characters; at most 253")
    if parts.path not in ("", "/"):
        raise ValueError(f"server url {url!r} must not have a path (the API lives under /v1)")
    return url.rstrip("/")


class WorkerConfig(EngineConfig):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = Field(None, description="when set, /v1/* requires 'Authorization: Bearer <key>'")
    max_request_body_mb: float = Field(32.0, gt=0, description="a request body over this many MiB is refused (413) "
                                                               "before it is read into memory")
    client_read_timeout_s: float = Field(30.0, gt=0, description="a client has this long to send a request's headers "
                                                                 "(else 408 and the connection closes), and may pause "
                                                                 "this long at most between parts of its body")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM/SIGINT: refuse new requests, let running ones "
                                                           "and their KV transfers finish for up to this long, "
                                                           "then exit (0: at once; a second signal: at once)")
    kv_events_port: int | None = Field(None, ge=0, le=65535,
                                       description="publish KV cache events on a ZeroMQ PUB socket (0 = free port)")
    join: str | None = Field(None, description="join the cluster of the orchestrator at this url (http://host:port) "
                                               "once serving, heartbeat, and leave on drain; needs role")
    role: Literal["context", "generation"] | None = Field(None, description="this instance's role when it joins")
    advertise_url: str | None = Field(None, description="the url the orchestrator reaches this instance at; "
                                                        "default: http://host:port (https with ssl_certfile)")
    join_token: str | None = Field(None, description="sent with every membership call as 'Authorization: Bearer': "
                                                     "the orchestrator's api_key, for an orchestrator without a "
                                                     "cluster_token (with one, the worker proves "
                                                     "cache_transceiver_config.cluster_token instead)")
    ssl_certfile: str | None = Field(None, description="serve https with this certificate (PEM); needs ssl_keyfile")
    ssl_keyfile: str | None = Field(None, description="the private key (PEM) of ssl_certfile")
    ssl_ca_file: str | None = Field(None, description="the CA certificates (PEM) trusted for an https join url; "
                                                      "default: the system's")

    @field_validator("join", "advertise_url")
    @classmethod
    def _check_url(cls, url: str | None) -> str | None:
        return None if url is None else server_url(url)

    @model_validator(mode="after")
    def _check_join(self) -> "WorkerConfig":
        check_tls_files(self.ssl_keyfile, self.ssl_certfile, self.ssl_ca_file)
        if (self.join is None) != (self.role is None):
            raise ValueError("join and role go together: set both (join: http://ORCHESTRATOR:PORT, "
                             "role: context | generation) or neither")
        if self.join is not None and self.advertise_url is None and self.host in ("0.0.0.0", "::", ""):
            raise ValueError(f"host {self.host!r} is no address the orchestrator can reach: set advertise_url "
                             "(http://THIS_HOST:PORT) to join")
        return self


def load_yaml(path: str | Path | None, cls: type[BaseModel], **overrides) -> BaseModel:
    """Read a YAML file (optional), apply CLI overrides that are not None, validate."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {p} must hold a mapping of keys to values, not {type(loaded).__name__}")
        data.update(loaded)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**data)
    except ValidationError as e:
        lines = [f"  {'.'.join(map(str, err['loc'])) or '<config>'}: {err['msg']}" for err in e.errors()]
        raise ValueError(f"invalid {cls.__name__}" + (f" in {path}" if path else "") + ":\n"
                         + "\n".join(lines)) from None
