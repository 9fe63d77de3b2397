"""MLA decode on this machine: attending in the latent space (absorbed) against expanding the cached latents to
per-head K and V (plain), one layer of models/mla.py.

    python benchmarks/bench_mla_decode.py [--heads 16] [--dtypes float32 bfloat16] [--contexts 256 1024 4096]

Both forms run the same MlaAttention layer (DeepSeek-V3's per-head shape: kv_lora_rank 512, qk_rope_head_dim 64,
qk_nope_head_dim 128, v_head_dim 128, hidden 2048; `--heads` of them, DeepSeek-V3 has 128, so 16 is one rank of
TP8) over a paged latent cache of tokens_per_block 32, from the layer's input to its o_proj output, and print
the median time of a decode step of `batch` sequences of `context` cached tokens each. The plain form runs
kv_b_proj over every cached token each step; the absorbed form multiplies each head's query and output once by
its block of kv_b_proj and attends over the 576-wide latents themselves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pdserve.models.attention import AttentionMetadata, PagedKVCache
from pdserve.models.shapes import MlaShape
from pdserve.models.layers import RotaryEmbedding, decode_step, pack_for_cpu
from pdserve.models.mla import MlaAttention
from pdserve.parallel.state import ParallelState

T = 32  # tokens per block
SHAPE = MlaShape(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 rope_interleave=False)
HIDDEN = 2048


class _Holder(torch.nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn


def _layer(heads: int, dtype: torch.dtype) -> MlaAttention:
    attn = MlaAttention(SHAPE, HIDDEN, heads, 1e-6, False, ParallelState(), dtype)
    g = torch.Generator().manual_seed(0)
    w = {n: (torch.randn(*p.shape, generator=g) / p.shape[-1] ** 0.5).to(dtype) for n, p in attn.named_parameters()}
    attn.load(lambda name: w[name.removeprefix("p.")], "p.")  # the checkpoint's names are the module's
    pack_for_cpu(_Holder(attn), gemv=True)
    return attn


def _time(attn: MlaAttention, absorb: bool, batch: int, context: int, dtype: torch.dtype, reps: int) -> float:
    blocks_per_seq = -(-(context + 1) // T)
    cache = PagedKVCache(torch.randn(batch * blocks_per_seq, 1, 1, 1, T, SHAPE.latent_dim).to(dtype), "HND")
    table = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context + 1)
    md = AttentionMetadata(slot_blocks=table[:, context // T], slot_offsets=torch.full((batch,), context % T),
                           prefills=[], decode_rows=torch.arange(batch), decode_blocks=table, decode_lens=lens,
                           tokens_per_block=T, decode_only=True)
    rope = RotaryEmbedding(SHAPE.qk_rope_head_dim, context + 1, 10000.0, None).table(lens - 1)
    x = torch.randn(batch, HIDDEN).to(dtype)
    attn.absorb_decode = absorb
    times = []
    with torch.inference_mode(), decode_step(True):
        for i in range(reps + 2):
            t0 = time.perf_counter()
            attn(x, rope, 0, cache, md)
            if i >= 2:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"MLA decode, one layer: {args.heads} heads, latent {SHAPE.latent_dim} (kv_lora {SHAPE.kv_lora_rank} + rope "
          f"{SHAPE.qk_rope_head_dim}), hidden {HIDDEN}; {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{'dtype':>9} {'batch':>5} {'context':>7} {'plain ms':>9} {'absorbed ms':>11} {'plain/absorbed':>14}")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        attn = _layer(args.heads, dtype)
        for batch in args.batches:
            for context in args.contexts:
                plain = _time(attn, False, batch, context, dtype, args.reps)
                absorbed = _time(attn, True, batch, context, dtype, args.reps)
                print(f"{name:>9} {batch:>5} {context:>7} {1e3 * plain:>9.2f} {1e3 * absorbed:>11.2f} "
                      f"{plain / absorbed:>14.2f}")


if __name__ == "__main__":
    main()
