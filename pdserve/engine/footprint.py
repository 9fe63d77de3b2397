"""How much memory each rank's weights, KV pool and recurrent state will take, known before any weight is read.

The weights are counted on the model's own modules built with their large tensors on PyTorch's `meta` device
(_LargeOnMeta): the very classes the engine loads into, with their shards, their replicated parts (MLA's latent
projections, a MoE router, every expert with `moe_experts: replicated`) and their dtypes, but no storage. A
checkpoint's tensors need not be opened: every weight is loaded at the serving dtype (an FP8 checkpoint's are
dequantized to it, weights/fp8.py), so config.json alone fixes the loaded size, and `pdserve plan` can size a
published model from its config.json.

Building every layer of a large model costs seconds (DeepSeek-V3's 58 MoE layers hold 14,848 expert modules),
so one model is built per kind of layer: layers that agree on every `*_layers` set of ModelConfig (sliding,
recurrent, cacheless, MoE) hold the same tensors. A rank's bytes are its stage's own (embeddings on the first
stage, the final norm and LM head on the last, tables every stage keeps) plus its layers', kind by kind.

The KV pool is the engine's own arithmetic (model_runner.num_kv_blocks: every rank holds as many blocks, sized
by the stage with the most KV layers), the recurrent state one slot per sequence that may run at once (two on
a disaggregated instance), as ModelRunner allocates them. The few blocks past the cache manager's (the static
decode step's padding block, the first-contact canary's) are left out.

    footprint(cfg, ecfg, device, max_model_len, tp, pp)        -> Footprint (one RankFootprint per rank)
    memory_problem(cfg, ecfg, device, available, units)        -> why it does not fit and a layout that does, or None
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from pdserve.config import EngineConfig
from pdserve.models.config import ModelConfig
from pdserve.models.layers import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, onednn_packs
from pdserve.models.llama import stage_layers
from pdserve.parallel.state import ParallelState

GIB = 1 << 30
_LINEARS = (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear)  # what layers.pack_for_cpu copies
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp8_e4m3": torch.float8_e4m3fn}
# ModelConfig's sets of layer indices: two layers in the same sets are built alike
_LAYER_SETS = tuple(f.name for f in fields(ModelConfig) if f.name.endswith("_layers") and f.name != "num_layers")


@dataclass(frozen=True)
class RankFootprint:
    """One rank's bytes: `weights` as loaded (parameters and buffers), `cpu_copies` the CPU's second copies
    (the decode GEMV's plain linear weights beside oneDNN's packed ones, a tied LM head's packed matrix),
    `kv_pool` and `state` the pools ModelRunner allocates."""

    rank: int
    layers: range  # the global layer indices of this rank's pipeline stage
    weights: int
    cpu_copies: int
    kv_pool: int
    state: int

    @property
    def total(self) -> int:
        return self.weights + self.cpu_copies + self.kv_pool + self.state


@dataclass(frozen=True)
class Footprint:
    tp: int
    pp: int
    ranks: tuple[RankFootprint, ...]
    num_kv_blocks: int
    tokens_per_block: int

    @property
    def total(self) -> int:
        return sum(r.total for r in self.ranks)

    @property
    def largest(self) -> RankFootprint:
        return max(self.ranks, key=lambda r: r.total)

    def describe(self) -> str:
        r = self.largest
        return (f"TP{self.tp} PP{self.pp}: per rank (the largest, rank {r.rank}) weights {r.weights / GIB:.2f} GiB"
                f"{f' + CPU copies {r.cpu_copies / GIB:.2f} GiB' if r.cpu_copies else ''}, KV pool "
                f"{r.kv_pool / GIB:.2f} GiB ({self.num_kv_blocks * self.tokens_per_block} tokens)"
                f"{f', recurrent state {r.state / GIB:.2f} GiB' if r.state else ''}; {len(self.ranks)} rank(s) "
                f"{self.total / GIB:.2f} GiB together")


def layer_kind(cfg: ModelConfig, layer: int) -> tuple[bool, ...]:
    return tuple(layer in getattr(cfg, name) for name in _LAYER_SETS)


class _LargeOnMeta(TorchFunctionMode):
    """Tensors of a million elements or more made on the meta device (shape and dtype, no storage), smaller ones
    on the CPU. Not `torch.device("meta")`: the RoPE tables a model computes at construction would run as meta
    ops, whose Python kernels import torch._dynamo on first use (2-3 s of every server's start); computed on the
    CPU for a few positions they cost nothing, and the parameters, the only large tensors, are empty factories."""

    _SIZED = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._SIZED and kwargs.get("device") is None:
            size = kwargs.get("size", args[0] if args else ())
            if isinstance(size, int):  # torch.empty(3, 4)
                size = [a for a in args if isinstance(a, int)]
            if math.prod(size) >= 1 << 20:
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


@dataclass(frozen=True)
class _Built:
    """Bytes of one meta-built stage: its own (outside the layers) and each local layer's."""

    stage: int
    layers: tuple[int, ...]
    stage_copies: int
    layer_copies: tuple[int, ...]


def _build(cfg: ModelConfig, kinds: tuple[tuple[bool, ...], ...], ps: ParallelState, dtype: torch.dtype,
           max_model_len: int, cpu_copies: bool) -> _Built:
    """The bytes of stage ps.pp_rank of a model whose layers are `kinds`, built on the meta device."""
    from pdserve.engine.model_runner import model_class

    sets = {name: tuple(j for j, k in enumerate(kinds) if k[i]) for i, name in enumerate(_LAYER_SETS)}
    small = replace(cfg, num_layers=len(kinds), **sets)
    with _LargeOnMeta():
        model = model_class(small)(small, ps, dtype, max_model_len)
    layers, stage = [0] * model.num_local_layers, 0
    layer_copies, stage_copies = [0] * model.num_local_layers, 0

    def where(name: str) -> int | None:
        parts = name.split(".")
        return int(parts[1]) if parts[0] == "layers" else None

    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        j, n = where(name), t.numel() * t.element_size()
        if j is None:
            stage += n
        else:
            layers[j] += n
    if cpu_copies and onednn_packs(dtype):  # layers.pack_for_cpu's second copies
        for name, m in model.named_modules():
            if isinstance(m, _LINEARS) and m.weight.is_floating_point():
                j, n = where(name), m.weight.numel() * m.weight.element_size()
                if j is None:
                    stage_copies += n
                else:
                    layer_copies[j] += n
        head = getattr(model, "lm_head", None)
        if head is not None and head is getattr(model, "embed_tokens", None):
            stage_copies += head.weight.numel() * head.weight.element_size()
    return _Built(stage, tuple(layers), stage_copies, tuple(layer_copies))


def _weights_by_kind(cfg: ModelConfig, tp: int, dtype: torch.dtype, max_model_len: int, cpu_copies: bool):
    """({kind: (layer bytes, copies)}, stage bytes by position): the position is "only" (PP1), "first",
    "middle" or "last" (a stage of a longer pipeline), each a (bytes, copies) pair.

    Only the position tables (RoPE's cos and sin, [positions, dims]) depend on the context, and linearly: the
    models are built for 2 and 3 positions and the difference extrapolated, so that no table of 163,840
    positions is computed to be counted."""
    two, three = _weights_at(cfg, tp, dtype, 2, cpu_copies), _weights_at(cfg, tp, dtype, 3, cpu_copies)

    def at(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        return tuple(x + (y - x) * (max_model_len - 2) for x, y in zip(a, b))

    return ({k: at(v, three[0][k]) for k, v in two[0].items()},
            {k: at(v, three[1][k]) for k, v in two[1].items()})


@lru_cache(maxsize=64)
def _weights_at(cfg: ModelConfig, tp: int, dtype: torch.dtype, max_model_len: int, cpu_copies: bool):
    kinds = tuple(dict.fromkeys(layer_kind(cfg, i) for i in range(cfg.num_layers)))
    whole = _build(cfg, kinds, ParallelState(tp, 1, 0), dtype, max_model_len, cpu_copies)
    per_kind = {k: (whole.layers[j], whole.layer_copies[j]) for j, k in enumerate(kinds)}
    stages = {"only": (whole.stage, whole.stage_copies)}
    if cfg.num_layers > 1:
        for pp, at in ((2, {0: "first", 1: "last"}), (3, {1: "middle"})):
            if cfg.num_layers >= pp:
                for p, position in at.items():
                    b = _build(cfg, (kinds[0],) * pp, ParallelState(tp, pp, p * tp), dtype, max_model_len, cpu_copies)
                    stages[position] = (b.stage, b.stage_copies)
    return per_kind, stages


def state_bytes_per_slot(cfg: ModelConfig, tp: int, dtype: torch.dtype) -> int:
    """One recurrent layer's state of one sequence on a rank: the conv's last inputs in the model's dtype and
    the fp32 SSM state (models/recurrent_state.py)."""
    if cfg.mamba is not None:
        from pdserve.models.mamba2 import mamba2_state

        g = mamba2_state(cfg.mamba, tp, dtype.itemsize)
    elif cfg.linear_attention is not None:
        from pdserve.models.gated_deltanet import deltanet_state

        g = deltanet_state(cfg.linear_attention, tp, dtype.itemsize)
    else:
        return 0
    return g.conv_channels * (g.taps - 1) * dtype.itemsize + math.prod(g.ssm_shape) * 4


def footprint(cfg: ModelConfig, ecfg: EngineConfig, device: str = "cpu", max_model_len: int | None = None,
              tp: int | None = None, pp: int | None = None) -> Footprint:
    """Every rank's bytes for serving `cfg` with `ecfg` (its dtype, pools and parallelism, or `tp` / `pp` in
    its place) on `device` ("cpu" or "cuda")."""
    from pdserve.engine.model_runner import kv_block_bytes, num_kv_blocks

    tp, pp = tp or ecfg.tensor_parallel_size, pp or ecfg.pipeline_parallel_size
    ecfg = ecfg.model_copy(update={"tensor_parallel_size": tp, "pipeline_parallel_size": pp})
    if cfg.moe is not None and ecfg.moe_experts == "replicated":
        cfg = replace(cfg, moe=replace(cfg.moe, replicated=True))
    dtype = _DTYPES[ecfg.dtype]
    kv_dtype = dtype if ecfg.kv_cache_dtype == "auto" else _DTYPES[ecfg.kv_cache_dtype]
    per_kind, stages = _weights_by_kind(cfg, tp, dtype, max_model_len or cfg.max_position_embeddings,
                                        device == "cpu" and ecfg.cpu_decode_gemv)
    blocks = num_kv_blocks(cfg, ecfg, kv_dtype)
    slots = (2 if ecfg.cache_transceiver_config.backend is not None else 1) * ecfg.max_num_seqs
    per_slot = state_bytes_per_slot(cfg, tp, dtype)
    counts, ranks = stage_layers(cfg.num_layers, pp), []
    for p, n in enumerate(counts):
        layers = range(sum(counts[:p]), sum(counts[:p]) + n)
        position = "only" if pp == 1 else "first" if p == 0 else "last" if p == pp - 1 else "middle"
        weights, copies = stages[position]
        for i in layers:
            w, c = per_kind[layer_kind(cfg, i)]
            weights, copies = weights + w, copies + c
        kv = blocks * kv_block_bytes(cfg, len(cfg.kv_layers(layers.start, n)), tp, ecfg.tokens_per_block, kv_dtype)
        state = slots * per_slot * sum(cfg.is_recurrent(i) for i in layers)
        ranks += [RankFootprint(p * tp + t, layers, weights, copies, kv, state) for t in range(tp)]
    return Footprint(tp, pp, tuple(ranks), blocks, ecfg.tokens_per_block)


def available_bytes(device: str) -> int:
    """What this machine has for one rank's pools and weights: on CPU the host's available RAM (every rank of
    the instance shares it), on CUDA the free memory of the smallest visible device."""
    if device == "cuda":
        return min(torch.cuda.mem_get_info(i)[0] if i == torch.cuda.current_device() else
                   torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _fits(fp: Footprint, device: str, available: int) -> bool:
    """On CPU every rank shares the host's memory; on CUDA each rank has a device of its own."""
    return (fp.total if device == "cpu" else fp.largest.total) <= available


def layouts(cfg: ModelConfig, units: int) -> list[tuple[int, int]]:
    """The (TP, PP) layouts of up to `units` ranks, in powers of two, that the model can take, fewest ranks
    first."""
    sizes = [1 << i for i in range(max(1, units).bit_length())]
    out = [(t, p) for t in sizes for p in sizes if t * p <= units and cfg.layout_problem(t, p) is None]
    return sorted(out, key=lambda tp_pp: (tp_pp[0] * tp_pp[1], tp_pp[1]))


def memory_problem(cfg: ModelConfig, ecfg: EngineConfig, device: str, available: int, units: int,
                   max_model_len: int | None = None) -> str | None:
    """Why `ecfg`'s weights, KV pool and recurrent state do not fit in `available` bytes (the host's, shared by
    every rank, on CPU; each device's on CUDA), naming a TP / PP of at most `units` ranks that fits, or that
    none does; None when they fit."""
    fp = footprint(cfg, ecfg, device, max_model_len)
    if _fits(fp, device, available):
        return None
    where = (f"they share this host, which has {available / GIB:.2f} GiB available" if device == "cpu" else
             f"rank {fp.largest.rank} needs {fp.largest.total / GIB:.2f} GiB of its device, which has "
             f"{available / GIB:.2f} GiB free")
    why = f"the model does not fit in memory (checked before loading any weight): {fp.describe()}; {where}"
    for t, p in layouts(cfg, units):
        other = footprint(cfg, ecfg, device, max_model_len, t, p)
        if (t, p) != (fp.tp, fp.pp) and _fits(other, device, available):
            return f"{why}. tensor_parallel_size={t}, pipeline_parallel_size={p} fits ({other.describe()})"
    hints = ["lower kv_cache_memory_gb" if fp.largest.kv_pool else "",
             "serve in bfloat16" if ecfg.dtype == "float32" else "",
             "set cpu_decode_gemv: false" if fp.largest.cpu_copies else ""]
    return (f"{why}. No TP / PP of up to {units} {'ranks' if device == 'cpu' else 'devices'} fits on this machine: "
            + ", ".join(h for h in hints if h) + (", or " if any(hints) else "") + "use a machine with more memory")


def check_memory(cfg: ModelConfig, ecfg: EngineConfig, device: str, max_model_len: int) -> str:
    """What this instance will hold and what is available (a line to log), or a ValueError, naming the numbers
    and a TP / PP that fits, when every rank's weights, KV pool and recurrent state need more than
    memory_limit_gb or, without it, than this machine has."""
    limit = ecfg.memory_limit_gb
    available = int(limit * GIB) if limit is not None else available_bytes(device)
    units = torch.cuda.device_count() if device == "cuda" else len(os.sched_getaffinity(0))
    why = memory_problem(cfg, ecfg, device, available, units, max_model_len)
    if why is not None:
        raise ValueError(why + (f" (memory_limit_gb={limit})" if limit is not None else ""))
    return f"memory: {footprint(cfg, ecfg, device, max_model_len).describe()}; {available / GIB:.2f} GiB available"
