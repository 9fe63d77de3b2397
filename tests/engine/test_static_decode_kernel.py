"""The decode attention kernel of CUDA steps (models/triton_decode.py), checked without a GPU: run by Triton's
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
from pdserve.models.triton_decode import paged_decode
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
print("ok")
"""


def test_fused_decode_kernel_matches_the_pytorch_path_interpreted():
    """The CUDA decode kernel, run by Triton's interpreter (its own process: the interpreter is chosen when
    Triton is imported): HND and NHD pools, fp32 and bf16, grouped query heads, blocks of 5 tokens,
    sequences of 1 to 40 keys, with and without a sliding window."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[2])
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("dtype,window,head_dim", [("bf16", 0, 64), ("fp32", 100, 80)])
def test_fused_decode_kernel_compiles_for_hopper(tmp_path, monkeypatch, dtype, window, head_dim):
    """The same kernel through Triton's real compiler, to an sm_90 cubin (Triton ships its own ptxas; no GPU
    needed): what the interpreter does not check (types of loop-carried values, constexpr branches) fails here."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdserve.models.triton_decode import _paged_decode_kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernel = triton.jit(_paged_decode_kernel)
    ints = ("tokens_per_block", "stride_qb", "stride_qh", "stride_kv", "stride_head", "stride_tok", "stride_tb")
    signature = {"q_ptr": f"*{dtype}", "pool_ptr": f"*{dtype}", "table_ptr": "*i64", "lens_ptr": "*i64",
                 "out_ptr": f"*{dtype}", "scale": "fp32", "stride_blk": "i64", **dict.fromkeys(ints, "i32")}
    constants = {"group": 3, "head_dim": head_dim, "D_PAD": triton.next_power_of_2(head_dim), "KEYS": 32,
                 "WINDOW": window}
    signature |= dict.fromkeys(constants, "constexpr")
    source = ASTSource(fn=kernel, signature={k: signature[k] for k in kernel.arg_names},
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()})
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
