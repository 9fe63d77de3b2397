"""A CPU decode step through a stage's layers in one native call (csrc/decode_layers.c).

With a few sequences in the batch, one token each, a decode step is ~120 skinny matrix products and
~150 small kernels and PyTorch ops; the Python around them (module calls, views, wrapper checks) is
a large share of a small model's step (docs/benchmarks.md, "The one-call decode step against the module
path"). `StageDecoder` hands the whole layer
stack to C, which calls the same kernels in the same order as `llama.DecoderLayer`
(docs/architecture.md).

It applies only where those kernels would all run anyway: on CPU, without tensor parallelism (a
row-parallel linear's all-reduce sits between kernels), with every linear keeping its plain weight
for the GEMV (`layers.pack_for_cpu(gemv=True)`, the `cpu_decode_gemv` config key), and for a step
of decode tokens only, as many as the module path sends to the GEMV (`cpu.SKINNY_ROWS`: up
to 16), and only for the plain Llama block: a stage with Qwen3's q/k norms, an o_proj bias or a MoE
MLP (which the C step does not compute) takes the module path. Anything else takes the module path,
which stays the reference.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.kernels import cpu


class _LayerArgs(ctypes.Structure):
    """Mirror of `layer_args` in csrc/decode_layers.c; field order and types must match."""

    _fields_ = [("cache", cpu._PoolView)] + [
        (name, ctypes.c_void_p) for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down")] + [
        ("window", ctypes.c_int64)]


class _StepArgs(ctypes.Structure):
    """Mirror of `step_args` in csrc/decode_layers.c; field order and types must match."""

    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "head_dim", "intermediate")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)] + [
        (name, ctypes.c_void_p) for name in ("cos", "signed_sin", "slot_block", "slot_offset", "block_table",
                                             "context_len")] + [
        ("max_blocks", ctypes.c_int64), ("rows", ctypes.c_int64)]


def _plain_llama(layer) -> bool:
    """Whether `layer` is the block csrc/decode_layers.c computes: no q/k norm, no o_proj bias, a dense MLP."""
    attn = layer.self_attn
    return attn.q_norm is None and attn.o_proj.bias is None and hasattr(layer.mlp, "gate_up_proj")


class StageDecoder:
    """Runs a one-token decode step through `model.layers` in C; see the module docstring."""

    def __init__(self, model, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.layers = model.layers
        self._args: ctypes.Array | None = None  # per layer, built on the first step (it needs the pool)
        self._pool: torch.Tensor | None = None

    @classmethod
    def for_model(cls, model) -> StageDecoder | None:
        """A decoder for `model`'s stage, or None where the native step does not apply."""
        lib = cpu.load()
        if model.ps.tp_size != 1 or not len(model.layers) or lib is None:
            return None
        if not all(_plain_llama(layer) for layer in model.layers):
            return None
        first = model.layers[0]
        dtype = first.input_layernorm.weight.dtype
        if first.input_layernorm.weight.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return None
        linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                          layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if any(m.gemv_weight is None for m in linears) or not cpu.native(cpu.PAGED_DECODE, dtype):
            return None  # (the C step runs the GEMV and the paged decode attention: not where PyTorch won)
        lib.decode_layers.argtypes = [ctypes.POINTER(_LayerArgs), ctypes.c_int64, ctypes.POINTER(_StepArgs),
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.decode_layers.restype = ctypes.c_int
        return cls(model, lib)

    def _layer_args(self, cache) -> ctypes.Array:  # cache: attention.PagedKVCache
        if self._args is None or self._pool is not cache.pool:
            args = (_LayerArgs * len(self.layers))()
            for i, layer in enumerate(self.layers):
                attn, mlp = layer.self_attn, layer.mlp
                bias = attn.qkv_proj.bias
                args[i] = _LayerArgs(cpu._layer_view(cache.pool, cache.layout, i, cache.scales),
                                     layer.input_layernorm.weight.data_ptr(),
                                     layer.post_attention_layernorm.weight.data_ptr(),
                                     attn.qkv_proj.gemv_weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                     attn.o_proj.gemv_weight.data_ptr(), mlp.gate_up_proj.gemv_weight.data_ptr(),
                                     mlp.down_proj.gemv_weight.data_ptr(), attn.window)
            self._args, self._pool = args, cache.pool
        return self._args

    def __call__(self, h: torch.Tensor, rope_table: tuple[torch.Tensor, torch.Tensor], cache,
                 md) -> torch.Tensor | None:
        """h: [rows, hidden], each decode token's input to the first local layer -> the last local layer's
        output, [rows, hidden]; None where the step is not decode tokens only, of a row count the module
        path gives the GEMV, or a kernel refused it (the caller then runs the modules). cache: the stage's
        attention.PagedKVCache; md: the step's attention.AttentionMetadata (the models' types, read by their
        fields)."""
        cos, signed_sin = rope_table
        indices = (md.slot_blocks, md.slot_offsets, md.decode_blocks, md.decode_lens)
        if (not md.decode_only or h.shape[0] not in cpu.SKINNY_ROWS.get(h.dtype, ())
                or h.shape[0] != md.decode_lens.numel() or cache.pool.dtype not in cpu._KV_DTYPES
                or not cos.is_contiguous() or not signed_sin.is_contiguous()
                or any(t.dtype != torch.int64 or not t.is_contiguous() for t in indices)):
            return None
        first = self.layers[0]
        attn = first.self_attn
        h = h.contiguous()
        out = torch.empty_like(h)
        step = _StepArgs(h.shape[1], attn.qkv_proj.num_heads, attn.head_dim, first.mlp.down_proj.gemv_weight.shape[1],
                         first.input_layernorm.eps, attn.scale, cos.data_ptr(), signed_sin.data_ptr(),
                         md.slot_blocks.data_ptr(), md.slot_offsets.data_ptr(), md.decode_blocks.data_ptr(),
                         md.decode_lens.data_ptr(), md.decode_blocks.shape[1], h.shape[0])
        args = self._layer_args(cache)
        status = self.lib.decode_layers(args, len(self.layers), ctypes.byref(step), h.data_ptr(), out.data_ptr(),
                                        cpu._FLOAT_DTYPES[h.dtype], cpu._KV_DTYPES[cache.pool.dtype],
                                        torch.get_num_threads())
        if status == -2:
            raise IndexError("decode step: a slot, block id or context length is outside the KV pool or block table")
        if status == -3:
            raise MemoryError("decode step: out of memory for its scratch buffers")
        return out if status == 0 else None
