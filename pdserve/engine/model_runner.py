"""One rank's model shard, KV pool and forward step.

Rank 0 turns the scheduler's batch into a `StepSpec` (plain data) and broadcasts it; every rank
rebuilds the same tensors from it, runs its pipeline stage, and hands hidden states to the next stage.
The last stage's first TP rank samples and returns the tokens to rank 0.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import msgpack
import torch
import torch.distributed as dist
from torch import nn

from pdserve.config import EngineConfig
from pdserve.engine.kv.connector import KVConnector, KVPoolGeometry, StateBuffer, shared_pool_allocator
from pdserve.engine.kv.wire import WIRE_VERSION, KVCommand, KVWireError, RankReport, command_from_wire, command_to_wire
from pdserve.engine import static_decode
from pdserve.engine.sampler import SampleResult, SampleSpec, sample
from pdserve.host_malloc import keep_freed_memory
from pdserve.kernels import cpu
from pdserve.models.attention import AttentionMetadata, PagedKVCache, SeqSlice
from pdserve.kv_transfer.page_table import Section
from pdserve.models.config import ModelConfig
from pdserve.kernels.kv_quant import FP8, KVScales, is_quantized
from pdserve.kernels.stage_decoder import StageDecoder
from pdserve.models.torch_paths import choose_paths
from pdserve.models.recurrent_state import RecurrentState, StateSlice
from pdserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from pdserve.models.llama import LlamaForCausalLM, stage_layers
from pdserve.models.nemotron_h import NemotronHForCausalLM
from pdserve.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration
from pdserve.models.layers import decode_step, pack_for_cpu
from pdserve.models.loader import checkpoint_renamer, load_weights, read_kv_scales
from pdserve.kv_transfer.canary import CANARY_SLOTS
from pdserve.kv_transfer.rank_info import RankInfo
from pdserve.parallel.state import ParallelState, broadcast_bytes, recv_bytes, send_bytes

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "fp8_e4m3": FP8}


@dataclass
class SeqStep:
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # absolute position of token_ids[0] (= tokens already in the cache)
    block_ids: list[int]  # the sequence's whole block table
    sample: SampleSpec | None  # when this step produces a token
    state_slot: int = -1  # its recurrent-state slot (hybrid models)


@dataclass
class StepSpec:
    seqs: list[SeqStep]
    kv: list[KVCommand] = field(default_factory=list)  # KV exchange commands (engine/kv/wire.py)
    shutdown: bool = False
    # (source, copy) pairs made before anything else: forked choices' last blocks and recurrent states
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    # {"v": WIRE_VERSION, "s": [SeqStep fields, its sample as a map of SampleSpec fields], "k": [KV
    # commands, kv/wire.py], "x": shutdown, "c": block copies, "sc": state copies}. Every rank runs the
    # same pdserve, so beyond the version nothing is checked: a field mismatch is a TypeError at once.
    def to_bytes(self) -> bytes:
        kv = [command_to_wire(c) for c in self.kv]
        return msgpack.packb({"v": WIRE_VERSION, "s": [asdict(s) for s in self.seqs], "k": kv, "x": self.shutdown,
                              "c": self.block_copies, "sc": self.state_copies})

    @classmethod
    def from_bytes(cls, data: bytes) -> "StepSpec":
        d = msgpack.unpackb(data)
        if d.get("v") != WIRE_VERSION:
            raise KVWireError(f"step spec of wire version {d.get('v')!r}, this rank speaks {WIRE_VERSION}: every "
                              "rank of an instance must run the same pdserve version")
        seqs = [SeqStep(**{**s, "sample": SampleSpec(**s["sample"]) if s["sample"] is not None else None})
                for s in d["s"]]
        return cls(seqs, [command_from_wire(c) for c in d["k"]], d["x"], [tuple(c) for c in d["c"]],
                   [tuple(c) for c in d["sc"]])


@dataclass
class StepResult:
    sampled: SampleResult | None
    kv_reports: list[RankReport] | None  # one per rank when the instance has a KV connector
    failure: str | None = None  # the forward pass raised: no token was sampled for any sequence of the step


class RanksOutOfStep(RuntimeError):
    """A rank's forward pass failed while the others may be inside a collective with it: the instance
    can no longer step, and only a restart recovers it."""


def _state_buffers(state: RecurrentState) -> list[StateBuffer]:
    """A hybrid model's state pools as the KV exchange sees them, each cut into its family's sections."""
    g = state.geometry
    return [StateBuffer("conv", state.conv, tuple(Section(*s) for s in g.conv_sections)),
            StateBuffer("ssm", state.ssm, tuple(Section(*s) for s in g.ssm_sections))]


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    own = {"Qwen3_5ForCausalLM": Qwen3_5ForCausalLM, "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM,
           "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
           "Qwen3_5MoeForConditionalGeneration": Qwen3_5ForConditionalGeneration,
           "NemotronHForCausalLM": NemotronHForCausalLM, "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM}
    return own.get(cfg.architecture, LlamaForCausalLM)


def kv_block_bytes(cfg: ModelConfig, num_layers: int, tp_size: int, tokens_per_block: int, dtype: torch.dtype) -> int:
    kv_heads = max(1, cfg.num_kv_heads // tp_size)
    return num_layers * cfg.kv_parts * kv_heads * tokens_per_block * cfg.head_dim * dtype.itemsize


def num_kv_blocks(cfg: ModelConfig, ecfg: EngineConfig, kv_dtype: torch.dtype) -> int:
    """Every rank computes the same count (block ids are global across ranks), sized by the largest stage."""
    if ecfg.num_kv_blocks:
        return ecfg.num_kv_blocks
    counts = stage_layers(cfg.num_layers, ecfg.pipeline_parallel_size)
    most_layers = max(len(cfg.kv_layers(sum(counts[:p]), n)) for p, n in enumerate(counts))  # layers with KV
    per_block = kv_block_bytes(cfg, most_layers, ecfg.tensor_parallel_size, ecfg.tokens_per_block, kv_dtype)
    return max(1, int(ecfg.kv_cache_memory_gb * 2**30) // per_block)


class ModelRunner:
    def __init__(self, ecfg: EngineConfig, model_cfg: ModelConfig, model_dir: Path, ps: ParallelState,
                 device: torch.device, max_model_len: int, instance_name: str, pool_allocator=None):
        self.ecfg = ecfg
        self.ps = ps
        self.device = device
        self.dtype = DTYPES[ecfg.dtype]
        self.kv_dtype = self.dtype if ecfg.kv_cache_dtype == "auto" else DTYPES[ecfg.kv_cache_dtype]
        self.tokens_per_block = ecfg.tokens_per_block
        if device.type == "cpu":
            keep_freed_memory()  # activations live in malloc'd host memory: see host_malloc.py
            cpu.load()  # build the native CPU kernels now, not inside the first request
        tc = ecfg.cache_transceiver_config
        if model_cfg.moe is not None and ecfg.moe_experts == "replicated":
            model_cfg = replace(model_cfg, moe=replace(model_cfg.moe, replicated=True))  # models/moe.py
        with torch.device(device):
            self.model = model_class(model_cfg)(model_cfg, ps, self.dtype, max_model_len)
        load_weights(self.model, model_dir, show_progress=ps.rank == 0)
        pack_for_cpu(self.model, gemv=ecfg.cpu_decode_gemv)
        if device.type == "cpu":  # each native kernel where it beats PyTorch on this machine
            # (MLA attends over its latents with SDPA, mla.py: no attention kernel of its to race; 0 heads)
            heads = 0 if model_cfg.mla is not None else model_cfg.num_heads // ps.tp_size
            choose_paths(self.model, self.dtype, heads, max(1, model_cfg.num_kv_heads // ps.tp_size),
                         model_cfg.head_dim, kv_dtype=self.kv_dtype)
        if isinstance(self.model, LlamaForCausalLM):
            self.model.stage_decoder = StageDecoder.for_model(self.model)  # None where it does not apply
        self.num_blocks = num_kv_blocks(model_cfg, ecfg, self.kv_dtype)
        self._allocator = pool_allocator or shared_pool_allocator(tc.backend)
        # One state slot per sequence that can run at once (the scheduler admits at most max_num_seqs), and
        # as many again for a disaggregated instance's requests whose state is in transfer (held or parked).
        per_seq = 2 if tc.backend is not None else 1
        self.num_state_slots = per_seq * ecfg.max_num_seqs if self.model.num_recurrent_layers else 0
        if self.num_state_slots:
            self.model.state = RecurrentState(self.model.state_geometry(self.dtype), self.model.num_recurrent_layers,
                                              self.num_state_slots, self.dtype, device, self._allocator)
        kv_heads = max(1, model_cfg.num_kv_heads // ps.tp_size)
        T, D, L = self.tokens_per_block, model_cfg.head_dim, self.model.num_kv_layers
        # The first-contact canary's blocks sit past the cache manager's: no request ever holds them.
        canary_slots = CANARY_SLOTS if tc.backend is not None and tc.canary and device.type == "cpu" else 0
        if tc.backend is not None and tc.canary and not canary_slots and ps.rank == 0:
            log.info("first-contact canary off: the KV cache is in %s memory (the canary needs host memory)", device)
        # The static decode step's padding rows write into a spare block past the cache manager's (before
        # the canary's, which are the pool's last)
        static = static_decode.applies(ecfg, self.model, ps, device)
        rows = self.num_blocks + int(static) + canary_slots
        P = model_cfg.kv_parts  # K and V, or MLA's one latent (of one "head": num_kv_heads 1)
        shape = [rows, L, P, kv_heads, T, D] if ecfg.kv_layout == "HND" else [rows, L, P, T, kv_heads, D]
        if self._allocator is not None:
            nbytes = rows * L * P * kv_heads * T * D * self.kv_dtype.itemsize
            self.pool = self._allocator(nbytes).view(self.kv_dtype).view(shape)
        else:
            self.pool = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        kv_layer_ids = model_cfg.kv_layers(self.model.first_layer, self.model.num_local_layers)
        scales = None  # an FP8 pool's static scales: the checkpoint's, else 1.0 (kernels/kv_quant.py)
        if is_quantized(self.kv_dtype):
            scales = KVScales.from_checkpoint(read_kv_scales(model_dir, checkpoint_renamer(self.model)), kv_layer_ids)
        self.cache = PagedKVCache(self.pool, ecfg.kv_layout, scales)
        self.static_decode = (static_decode.for_runner(ecfg, self.model, self.cache, device, max_model_len,
                                                       pad_block=self.num_blocks) if static else None)
        self.kv_heads_per_rank = kv_heads
        self.connector: KVConnector | None = None
        if tc.backend is not None:
            first, local = self.model.first_layer, self.model.num_local_layers
            geometry = KVPoolGeometry(
                ecfg.kv_layout, first, tuple(stage_layers(model_cfg.num_layers, ps.pp_size)),
                model_cfg.num_kv_heads, kv_heads, model_cfg.head_dim, self.tokens_per_block, canary_slots,
                kv_layer_ids=tuple(model_cfg.kv_layers(first, local)), latent=model_cfg.mla is not None,
                kv_scales=scales)
            state = _state_buffers(self.model.state) if self.num_state_slots else []
            state_layers = tuple(i for i in range(first, first + local) if model_cfg.is_recurrent(i))
            self.connector = KVConnector(tc, ps, instance_name, self.pool, geometry, state, state_layers)
            gathered = self._all_gather_bytes(self.connector.info.to_bytes())
            self.connector.start([RankInfo.from_bytes(b) for b in gathered])

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's bytes, in rank order, on every rank (gathered to rank 0, then broadcast)."""
        if self.ps.world_size == 1:
            return [data]
        if self.ps.rank == 0:
            parts = [data] + [recv_bytes(r, group=self.ps.cpu_group) for r in range(1, self.ps.world_size)]
            return msgpack.unpackb(broadcast_bytes(msgpack.packb(parts), group=self.ps.cpu_group))
        send_bytes(data, dst=0, group=self.ps.cpu_group)
        return msgpack.unpackb(broadcast_bytes(None, group=self.ps.cpu_group))

    # -- the step -----------------------------------------------------------------------------

    def step(self, spec: StepSpec) -> StepResult:
        """Rank 0 entry point: share the spec with the other ranks, run, collect their results."""
        if self.ps.world_size > 1:
            broadcast_bytes(spec.to_bytes(), group=self.ps.cpu_group)
        return self.execute(spec)

    def serve_forever(self) -> None:
        """Non-zero ranks: run every spec rank 0 broadcasts until it says shut down."""
        while True:
            spec = StepSpec.from_bytes(broadcast_bytes(None, group=self.ps.cpu_group))
            if spec.shutdown:
                self.close()
                return
            self.execute(spec)

    def shutdown(self) -> None:
        if self.ps.world_size > 1:
            broadcast_bytes(StepSpec([], shutdown=True).to_bytes(), group=self.ps.cpu_group)
        self.close()

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
            self.connector = None

    def execute(self, spec: StepSpec) -> StepResult:
        """Every rank: forked choices' copies, KV exchange commands and polls, then the forward step. Only
        rank 0's return value carries anything; the other ranks send theirs to it."""
        self._copy(spec)
        report = self.connector.apply(spec.kv) if self.connector is not None else None
        sampled, failure = None, None
        if spec.seqs:
            try:
                sampled = self._forward(spec)
            except Exception as e:
                if self.ps.world_size > 1:
                    raise RanksOutOfStep(f"rank {self.ps.rank}'s forward step failed: {type(e).__name__}: {e}") from e
                # One process: nothing else is mid-step, so only this step's requests are lost.
                log.exception("the forward step failed; its requests fail, the engine goes on")
                failure = f"{type(e).__name__}: {e}"
        if report is None:
            return StepResult(sampled, None, failure)
        if self.ps.rank != 0:
            send_bytes(msgpack.packb(report.to_wire()), dst=0, group=self.ps.cpu_group)
            return StepResult(None, None)
        reports = [report] + [RankReport.from_wire(msgpack.unpackb(recv_bytes(r, group=self.ps.cpu_group)))
                             for r in range(1, self.ps.world_size)]
        return StepResult(sampled, reports, failure)

    @torch.inference_mode()
    def _copy(self, spec: StepSpec) -> None:
        """Make the copies a fork asked for, before a transfer or a forward step can write their sources."""
        if spec.block_copies:
            src, dst = (torch.tensor(side, dtype=torch.long, device=self.device) for side in zip(*spec.block_copies))
            self.pool[dst] = self.pool[src]
        if spec.state_copies and self.num_state_slots:  # (a PP stage without recurrent layers has none)
            src, dst = (torch.tensor(side, dtype=torch.long, device=self.device) for side in zip(*spec.state_copies))
            for buf in (self.model.state.conv, self.model.state.ssm):
                buf[dst] = buf[src]

    @torch.inference_mode()
    def _forward(self, spec: StepSpec) -> SampleResult | None:
        if self.static_decode is not None and self.static_decode.fits(spec.seqs):  # (one rank: world_size 1)
            return self.static_decode.step(spec.seqs)
        ids, positions, md, sample_rows = self._prepare(spec)
        ps = self.ps
        if ps.is_first_stage:
            x = ids
        else:
            x = torch.empty(len(ids), self.model.cfg.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(x, src=ps.stage_rank(ps.pp_rank - 1))
        # The last stage needs hidden states only where a token is sampled (all rows in a decode step).
        out_rows = None
        if ps.is_last_stage and len(sample_rows) < len(ids):
            out_rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        with decode_step(md.decode_only):  # decode-only steps of a few rows take the GEMV (layers.py)
            h = self.model(x, positions, self.cache, md, out_rows)
        if not ps.is_last_stage:
            dist.send(h.contiguous(), dst=ps.stage_rank(ps.pp_rank + 1))
            return self._result_from_last_stage() if ps.rank == 0 else None
        if not sample_rows:
            return self._deliver(SampleResult([], [], []))
        logits = self.model.compute_logits(h)
        if ps.tp_rank != 0:
            return None
        specs = [s.sample for s in spec.seqs if s.sample is not None]
        return self._deliver(sample(logits, specs))

    def _deliver(self, result: SampleResult) -> SampleResult | None:
        if self.ps.rank == 0:
            return result
        if self.ps.rank == self.ps.last_stage_leader:
            send_bytes(msgpack.packb({"v": WIRE_VERSION, "b": asdict(result)}), dst=0, group=self.ps.cpu_group)
        return None

    def _result_from_last_stage(self) -> SampleResult:
        w = msgpack.unpackb(recv_bytes(self.ps.last_stage_leader, group=self.ps.cpu_group))
        if w.get("v") != WIRE_VERSION:
            raise KVWireError(f"sampled tokens of wire version {w.get('v')!r}, this rank speaks {WIRE_VERSION}")
        r = SampleResult(**w["b"])
        r.top_logprobs = [[tuple(p) for p in t] if t is not None else None for t in r.top_logprobs]
        return r

    def _prepare(self, spec: StepSpec):
        T = self.tokens_per_block
        dev = self.device
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        prefills: list[SeqSlice] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        sample_rows: list[int] = []
        states: list[StateSlice] = []
        for s in spec.seqs:
            start, n = s.start_pos, len(s.token_ids)
            row = len(ids)
            pos = range(start, start + n)
            ids += s.token_ids
            positions += pos
            slot_blocks += [s.block_ids[p // T] for p in pos]
            slot_offsets += [p % T for p in pos]
            ctx = start + n
            nblocks = -(-ctx // T)
            if n == 1 and start > 0:
                decode_rows.append(row)
                decode_tables.append(s.block_ids[:nblocks])
                decode_lens.append(ctx)
            else:
                prefills.append(SeqSlice(row, n, ctx, torch.tensor(s.block_ids[:nblocks], device=dev)))
            if s.sample is not None:
                sample_rows.append(row + n - 1)
            if s.state_slot >= 0:
                states.append(StateSlice(row, n, start == 0, s.state_slot))
        max_blocks = max((len(t) for t in decode_tables), default=0)
        table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in decode_tables], dtype=torch.long, device=dev)
        md = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=dev),
            prefills=prefills,
            decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=dev),
            decode_blocks=table.view(len(decode_tables), max_blocks),
            decode_lens=torch.tensor(decode_lens, dtype=torch.long, device=dev),
            tokens_per_block=T,
            decode_only=not prefills,
            states=states,
        )
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                md, sample_rows)
