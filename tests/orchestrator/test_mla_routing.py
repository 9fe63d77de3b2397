"""The kv_cache_aware router over DeepSeek-V3 instances, whose cache is MLA's latent: one 40-wide vector per token
and layer (kv_lora 32 + rope 8), a quarter of what per-head K and V of the same model would take (4 heads of
24 + 16 dims).

Two real `pdserve serve` workers (KV events on, 16 tokens per block where the harness's models use 8), each with a
pool of kv_cache_memory_gb worth 24 latent blocks: 384 tokens, where per-head K and V would fit 6 blocks (96
tokens) and could not keep an 11-block prompt at all. The router counts a prompt's cached prefix in the worker's
own blocks (the tokens_per_block of its /v1/disagg_info; hashed at 8 tokens, no block would match), so a prompt
that repeats a long prefix goes back to the instance that holds every one of its latent blocks, and is served
from there as a prefix-cache hit of all of them."""

from __future__ import annotations

import httpx
import pytest
from harness import MODEL_NAME, AppThread, caught_up, router_views, start_each, wait_healthy

from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.config import DisaggConfig
from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3

TPB = 16
LAYERS, LATENT, HEADS, QK, V = 3, 32 + 8, 4, 16 + 8, 16  # make_tiny_deepseek_v3's default shape
LATENT_BLOCK = LAYERS * LATENT * 4 * TPB  # fp32 bytes of one block of latents
BLOCKS = 24


@pytest.fixture(scope="module")
def mla_workers(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-routing")
    model = make_tiny_deepseek_v3(root / "ds", max_position_embeddings=512)
    memory = (BLOCKS + 0.5) * LATENT_BLOCK / 2**30  # 24 whole latent blocks
    extra = {"tokens_per_block": TPB, "kv_events_port": 0, "num_kv_blocks": None, "kv_cache_memory_gb": memory}
    ws = start_each(model, root, [extra] * 2)
    yield ws
    for w in ws:
        w.stop()


def test_a_repeated_prefix_goes_to_the_instance_holding_its_latent_blocks(mla_workers):
    per_token_kv = LAYERS * HEADS * (QK + V) * 4  # what per-head K and V of this model would take
    assert per_token_kv == 4 * LAYERS * LATENT * 4
    for w in mla_workers:  # the pool is sized by the latent's bytes
        assert w.metric("pdserve_kv_cache_blocks_total") == BLOCKS
    a = list(range(10, 10 + 10 * TPB)) + [7, 8, 9]  # 163 tokens: 10 whole blocks
    b = list(range(300, 300 + 10 * TPB)) + [7, 8, 9]
    assert BLOCKS * LATENT_BLOCK // (per_token_kv * TPB) < 11  # per-head K and V could not keep either
    body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    cfg = DisaggConfig(context_servers={"urls": [], "minimal_instances": 0},
                       generation_servers={"urls": [w.url for w in mla_workers], "router": {"type": "kv_cache_aware"}})
    with AppThread(build_app(cfg)) as orch, httpx.Client(base_url=orch.url, timeout=60) as client:
        wait_healthy(orch.url)
        first = client.post("/v1/completions", json={**body, "prompt": a}).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        views = caught_up(orch.url, mla_workers)
        holder = next(url for url, v in views.items() if v["selected"] == 1)
        # 163 prompt tokens + 4 generated: 10 whole blocks hashed, the 11th partial
        assert {url: v["cached_blocks"] for url, v in views.items()} == \
            {w.url: 10 if w.url == holder else 0 for w in mla_workers}
        for suffix in (11, 12):
            out = client.post("/v1/completions", json={**body, "prompt": a[:10 * TPB] + [suffix, 5]}).json()
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 10 * TPB
            caught_up(orch.url, mla_workers)
        other = client.post("/v1/completions", json={**body, "prompt": b}).json()  # no prefix anywhere: the idle one
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        caught_up(orch.url, mla_workers)
        again = client.post("/v1/completions", json={**body, "prompt": b[:10 * TPB] + [4]}).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 10 * TPB
        views = router_views(orch.url)
    assert {url: v["selected"] for url, v in views.items()} == \
        {w.url: 3 if w.url == holder else 2 for w in mla_workers}
