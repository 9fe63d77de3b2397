"""CUDA graphs of the static decode step (engine/static_decode.py) and the fused paged decode kernel
(kernels/triton_decode.py) on a CUDA device: graph replays give the eager steps' tokens, every graph is
captured (a capture fails on any host synchronisation inside the step), and the kernel compiled for
the device agrees with the PyTorch path. Skipped without a device (scripts/gpu_check runs them first)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing import make_tiny_model

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
VOCAB = 512


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=3, num_heads=8, num_kv_heads=2,
                               vocab_size=VOCAB))


def _engine(model: str, graphs: bool, dtype: str = "float32") -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cuda", dtype=dtype, max_model_len=256, num_kv_blocks=96,
                                  tokens_per_block=8, enable_prefix_caching=False, cuda_graphs=graphs,
                                  cuda_graph_batch_sizes=[1, 2, 4, 8]))


def _drive(engines, prompts, params, joins) -> list[dict]:
    outputs: list[dict] = [{} for _ in engines]
    for step in range(40):
        for e, out in zip(engines, outputs):
            if step in joins:
                i = joins[step]
                e.add_request(prompts[i], params[i], request_id=f"r{i}")
            for o in e.step():
                tokens, logprobs = out.setdefault(o.request_id, ([], []))
                tokens += o.new_token_ids
                logprobs += [(x["token_id"], round(x["logprob"], 4)) for x in o.new_logprobs]
    return outputs


def test_graph_replays_give_the_eager_tokens(tiny):
    """Greedy and seeded rows (temperature, top-k, top-p, min-p, logprobs), requests joining and leaving, batches
    padded to 8 and 4: the replayed graphs' tokens are the eager CUDA steps' tokens."""
    rnd = random.Random(2)
    prompts = [[rnd.randrange(3, VOCAB) for _ in range(n)] for n in (3, 17, 9, 30, 5)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.9, top_k=20, top_p=0.8, seed=5, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=10, temperature=1.2, min_p=0.05, seed=-3, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=18, temperature=0.7, seed=11, ignore_eos=True)]
    eager, graphed = _engine(tiny, False), _engine(tiny, True)
    try:
        outputs = _drive((eager, graphed), prompts, params, {i: i for i in range(5)})
        assert [outputs[1][f"r{i}"][0] for i in range(5)] == [outputs[0][f"r{i}"][0] for i in range(5)]
        assert outputs[1] == outputs[0]  # logprobs too (to 4 places: two kernels' sums)
        step = graphed.runner.static_decode
        assert step.replays == sum(step.steps.values()) and step.steps[8] >= 3, step.steps
        assert eager.runner.static_decode is None
    finally:
        eager.shutdown()
        graphed.shutdown()


def test_every_graph_is_captured(tiny):
    """A host synchronisation inside the step (an .item(), a .tolist(), a pageable copy) fails its capture,
    which would leave that variant eager (None): every bucket's greedy graph is captured at start, and the
    sampling and logprobs variants at first use."""
    e = _engine(tiny, True, "bfloat16")
    try:
        step = e.runner.static_decode
        assert all(step._graphs[(b, False, False)] is not None for b in step.buckets)
        e.add_request(list(range(5, 40)), SamplingParams(max_tokens=4, temperature=0.8, seed=1, logprobs=2,
                                                         ignore_eos=True))
        while e.has_unfinished():
            e.step()
        assert step._graphs[(1, True, True)] is not None and step.replays >= 2
    finally:
        e.shutdown()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_kernel_matches_sdpa(layout, dtype):
    from pdserve.models.attention import AttentionMetadata, PagedKVCache, _sdpa_decode
    from pdserve.kernels.triton_decode import paged_decode

    g = torch.Generator().manual_seed(0)
    blocks, kv_heads, T, d, heads = 64, 3, 16, 64, 9
    shape = [blocks, 2, 2, kv_heads, T, d] if layout == "HND" else [blocks, 2, 2, T, kv_heads, d]
    pool = torch.randn(shape, generator=g).to(dtype).cuda()
    lens = torch.tensor([1, 16, 17, 300, 511], device="cuda")
    table = torch.stack([torch.randperm(blocks, generator=g)[:32] for _ in range(5)]).cuda()
    q = torch.randn(5, heads, d, generator=g).to(dtype).cuda()
    md = AttentionMetadata(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long), [],
                           torch.arange(5, device="cuda"), table, lens, T, True)
    for window in (0, 100):
        ref = _sdpa_decode(q, 1, PagedKVCache(pool, layout), md, d ** -0.5, window).reshape(5, heads, d).float()
        out = paged_decode(q, pool, layout, 1, table, lens, d ** -0.5, window)
        assert (out.float() - ref).abs().max().item() < (1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_cache_write_gives_the_pytorch_bits(layout, dtype):
    """One kernel for RoPE and the K/V write (kernels/triton_rope.py) writes what RotaryEmbedding.rotate and
    PagedKVCache.write write, bit for bit, at a decode's few tokens and a prefill's many (the two forms of
    rotate)."""
    from pdserve.models.attention import AttentionMetadata, PagedKVCache
    from pdserve.models.layers import RotaryEmbedding
    from pdserve.kernels.triton_rope import rope_cache_write

    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, T, blocks = 9, 3, 64, 16, 32
    rope = RotaryEmbedding(d, 4096, 100000.0, None).cuda()
    for n in (3, 200):
        table = rope.table(torch.randint(0, 4000, (n,), generator=g).cuda())
        qkv = torch.randn(n, heads + 2 * kv_heads, d, generator=g).to(dtype).cuda()
        shape = [blocks, 2, 2, kv_heads, T, d] if layout == "HND" else [blocks, 2, 2, T, kv_heads, d]
        ref_pool, pool = torch.zeros(shape, dtype=dtype, device="cuda"), torch.zeros(shape, dtype=dtype, device="cuda")
        slots = torch.randperm(blocks * T, generator=g)[:n].cuda()
        md = AttentionMetadata(slots // T, slots % T, [], torch.arange(0), torch.zeros(0, 1, dtype=torch.long),
                               torch.zeros(0, dtype=torch.long), T)
        ref = RotaryEmbedding.rotate(qkv[:, :heads + kv_heads], table)
        PagedKVCache(ref_pool, layout).write(1, ref[:, heads:], qkv[:, heads + kv_heads:], md)
        out = rope_cache_write(qkv, heads, *table, pool, layout, 1, slots // T, slots % T)
        assert torch.equal(out, ref) and torch.equal(pool, ref_pool), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_matches_the_pytorch_form(dtype):
    """One kernel for the residual add and RMSNorm (kernels/triton_norm.py): the add's bits, and the norm within
    the last bit of RMSNorm.torch_forward (its sum of squares is reduced in another order)."""
    from pdserve.models.layers import RMSNorm
    from pdserve.kernels.triton_norm import rms_norm

    g = torch.Generator().manual_seed(2)
    for hidden, rows in ((576, 1), (576, 16), (4096, 300)):
        norm = RMSNorm(hidden, 1e-5, dtype).cuda()
        norm.weight.copy_(torch.randn(hidden, generator=g).to(dtype))
        x, y = (torch.randn(rows, hidden, generator=g).to(dtype).cuda() for _ in range(2))
        h, out = rms_norm(y, norm.weight, 1e-5, residual=x)
        assert torch.equal(h, x + y)
        want = norm.torch_forward(x + y).float()
        step = want.abs() * (2 ** -7 if dtype == torch.bfloat16 else 1e-5) + 1e-6
        assert ((out.float() - want).abs() <= step).all(), (hidden, rows)
