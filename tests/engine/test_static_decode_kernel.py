"""The decode attention kernel of CUDA steps (kernels/triton_decode.py), checked without a GPU: run by Triton's
interpreter against the PyTorch path (gather + SDPA), and compiled by Triton's real compiler for Hopper.
On a GPU, test_static_decode_cuda.py runs it compiled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_INTERPRETED = """
import torch
from pdserve.models.attention import AttentionMetadata, PagedKVCache, _sdpa_decode
from pdserve.kernels.triton_decode import paged_decode
g = torch.Generator().manual_seed(0)
for layout, dtype, window in (("HND", torch.float32, 0), ("NHD", torch.float32, 6), ("HND", torch.bfloat16, 6)):
    blocks, layers, kv_heads, T, d, heads = 20, 2, 2, 5, 16, 6  # 3 query heads a KV head; 5-token blocks
    shape = [blocks, layers, 2, kv_heads, T, d] if layout == "HND" else [blocks, layers, 2, T, kv_heads, d]
    pool = torch.randn(shape, generator=g).to(dtype)
    lens = torch.tensor([1, 7, 23, 40])
    table = torch.stack([torch.randperm(blocks, generator=g)[:9] for _ in range(4)])
    q = torch.randn(4, heads, d, generator=g).to(dtype)
    md = AttentionMetadata(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), [],
                           torch.arange(4), table, lens, T, True)
    ref = _sdpa_decode(q, 1, PagedKVCache(pool, layout), md, 0.25, window).reshape(4, heads, d).float()
    out = paged_decode(q, pool, layout, 1, table, lens, 0.25, window)
    err = (out.float() - ref).abs().max().item()
    assert out.dtype == dtype and err < (1e-5 if dtype == torch.float32 else 2e-2), (layout, dtype, window, err)

from pdserve.models.layers import RotaryEmbedding
from pdserve.kernels.triton_rope import rope_cache_write
heads, kv_heads, d, T, blocks = 6, 2, 16, 4, 24
rope = RotaryEmbedding(d, 256, 10000.0, None)
for layout, dtype, pool_dtype, n in (("HND", torch.float32, torch.float32, 5), ("NHD", torch.float32, torch.float32, 9),
                                     ("HND", torch.bfloat16, torch.float32, 3)):
    table = rope.table(torch.randint(0, 200, (n,), generator=g))
    qkv = torch.randn(n, heads + 2 * kv_heads, d, generator=g).to(dtype)
    shape = [blocks, 2, 2, kv_heads, T, d] if layout == "HND" else [blocks, 2, 2, T, kv_heads, d]
    ref_pool, pool = torch.zeros(shape, dtype=pool_dtype), torch.zeros(shape, dtype=pool_dtype)
    slots = torch.randperm(blocks * T, generator=g)[:n]  # distinct slots
    md = AttentionMetadata(slots // T, slots % T, [], torch.arange(0), torch.zeros(0, 1, dtype=torch.long),
                           torch.zeros(0, dtype=torch.long), T)
    ref = RotaryEmbedding.rotate(qkv[:, :heads + kv_heads], table)
    PagedKVCache(ref_pool, layout).write(1, ref[:, heads:], qkv[:, heads + kv_heads:], md)
    out = rope_cache_write(qkv, heads, *table, pool, layout, 1, slots // T, slots % T)
    if dtype == torch.float32:  # the same bits
        assert torch.equal(out, ref) and torch.equal(pool, ref_pool), (layout, n)
    else:  # (the interpreter casts fp32 to bf16 by truncation, the GPU to nearest: within one bf16 step)
        step = ref.float().abs() * 2 ** -7 + 1e-30
        assert ((out.float() - ref.float()).abs() <= step).all() and ((pool - ref_pool).abs() <= 2 ** -6).all()
        assert pool.count_nonzero() == ref_pool.count_nonzero() == n * 2 * kv_heads * d

from pdserve.models.layers import RMSNorm
from pdserve.kernels.triton_norm import rms_norm
for dtype, hidden, rows in ((torch.float32, 96, 5), (torch.bfloat16, 160, 3), (torch.float16, 64, 2)):
    norm = RMSNorm(hidden, 1e-5, dtype)
    norm.weight.copy_(torch.randn(hidden, generator=g).to(dtype))
    x, y = (torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2))
    (h, out), (_, alone) = rms_norm(y, norm.weight, 1e-5, residual=x), rms_norm(x, norm.weight, 1e-5)
    for got, want in ((h, x + y), (out, norm.torch_forward(x + y)), (alone, norm.torch_forward(x))):
        # (fp32 and fp16 within rounding; bf16 within a few steps: the interpreter casts by truncation, three
        # times on the way: the sum, the normalised row, the product)
        step = want.float().abs() * (2 ** -5 if dtype == torch.bfloat16 else 1e-5) + 1e-6
        assert got.dtype == dtype and ((got.float() - want.float()).abs() <= step).all(), dtype
print("ok")
"""


def test_fused_kernels_match_the_pytorch_paths_interpreted():
    """The CUDA kernels, run by Triton's interpreter (its own process: the interpreter is chosen when Triton
    is imported). Decode attention: HND and NHD pools, fp32 and bf16, grouped query heads, blocks of 5 tokens,
    sequences of 1 to 40 keys, with and without a sliding window. RoPE + cache write: the bits of
    RotaryEmbedding.rotate and PagedKVCache.write in fp32 (HND and NHD), and in bf16 into
    an fp32 pool. RMSNorm with and without the residual add: RMSNorm.torch_forward's values, fp32, bf16, fp16."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[2])
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


def _compile(kernel_fn, pointers: dict[str, str], constants: dict, options: dict | None = None):
    """Triton's real compiler on `kernel_fn` for sm_90; every argument not named is an i32 but stride_blk (i64)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = triton.jit(kernel_fn)
    kinds = {name: pointers.get(name, "constexpr" if name in constants else "i64" if name == "stride_blk" else "i32")
             for name in kernel.arg_names} | {"scale": "fp32"}
    source = ASTSource(fn=kernel, signature={k: kinds[k] for k in kernel.arg_names},
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


@pytest.mark.parametrize("dtype,window,head_dim", [("bf16", 0, 64), ("fp32", 100, 80)])
def test_fused_kernels_compile_for_hopper(tmp_path, monkeypatch, dtype, window, head_dim):
    """The same kernels through Triton's real compiler, to sm_90 cubins (Triton ships its own ptxas; no GPU
    needed): what the interpreter does not check (types of loop-carried values, constexpr branches) fails here."""
    pytest.importorskip("triton")
    from pdserve.kernels.triton_decode import _paged_decode_kernel
    from pdserve.kernels.triton_norm import _rms_norm_kernel
    from pdserve.kernels.triton_rope import _rope_cache_kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    pointers = {"table_ptr": "*i64", "lens_ptr": "*i64", "blocks_ptr": "*i64", "offsets_ptr": "*i64"}
    pointers |= {p: f"*{dtype}" for p in ("q_ptr", "pool_ptr", "out_ptr", "qkv_ptr", "qk_ptr")}
    pointers |= {"cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    pad = 1 << (head_dim - 1).bit_length()
    assert _compile(_paged_decode_kernel, pointers, {"group": 3, "head_dim": head_dim, "D_PAD": pad, "KEYS": 32,
                                                     "WINDOW": window})
    assert _compile(_rope_cache_kernel, pointers, {"HALF": head_dim // 2, "H_PAD": pad // 2},
                    {"enable_fp_fusion": False})
    pointers |= {p: f"*{dtype}" for p in ("x_ptr", "res_ptr", "h_ptr", "w_ptr")}
    assert _compile(_rms_norm_kernel, pointers | {"eps": "fp32"}, {"ADD": window > 0, "CAST": dtype == "bf16",
                                                                  "BLOCK": 1024})


def test_a_kernel_that_fails_here_leaves_the_pytorch_path_said_once(monkeypatch, caplog):
    """A machine whose Triton cannot build or launch a kernel (no C compiler for its launcher, a driver too old)
    decodes through the PyTorch path: the wrappers return None from then on, and say why once."""
    pytest.importorskip("triton")
    import torch

    from pdserve.kernels import triton_decode, triton_norm, triton_rope

    def unbuildable(interpret):
        raise RuntimeError("no compiler here")

    for module in (triton_decode, triton_rope, triton_norm):
        monkeypatch.setattr(module, "_kernel", unbuildable)
        monkeypatch.setattr(module, "_failed", [])
    pool = torch.zeros(4, 1, 2, 2, 4, 8)
    table, lens, q = torch.zeros(1, 2, dtype=torch.long), torch.tensor([3]), torch.zeros(1, 4, 8)
    qkv, cos = torch.zeros(1, 8, 8), torch.zeros(1, 1, 8)
    slot = torch.zeros(1, dtype=torch.long)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            assert triton_decode.paged_decode(q, pool, "HND", 0, table, lens, 0.5) is None
            assert triton_rope.rope_cache_write(qkv, 4, cos, cos, pool, "HND", 0, slot, slot) is None
            assert triton_norm.rms_norm(q, torch.ones(8), 1e-5) is None
    assert [r.getMessage().count("no compiler here") for r in caplog.records] == [1, 1, 1]
