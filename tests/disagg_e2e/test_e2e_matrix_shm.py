"""Topology matrix over the shared-memory transfer agent: through `pdserve disaggregated` and the official
openai client, greedy output equals one aggregated instance token for token.

HND, 16 tokens per block: tp2->tp1, tp1->tp2, tp2->pp2, pp2->tp2, tp2pp2->tp1, and with KV heads
replicated at tp4 (2 KV heads over 4 ranks): tp4->tp1, tp2->tp4; 16 -> 32 tokens per block (tp2->tp1).
generation_first (the first token arrives with the KV): pipelined tp2->tp1 and tp2->tp4 (tp2 prefills in
24-token chunks, sending each chunk's blocks as it goes), and whole-prompt pp2->tp2. NHD: tp2pp2->tp1.
A HND context instance with an NHD generation instance is refused with a clear error and leaves no
KV block allocated."""

from __future__ import annotations

import httpx
import pytest
from e2e_checks import PROMPT_IDS, check_split
from e2e_cluster import MODEL_NAME, TINY_BASE, Orchestrator, Spec, start_instances, stop_instances

# A context instance frees a request's KV when its transfer times out; short here so the refused
# transfers below are checked for leaks in seconds, long enough for a loaded 2-core machine.
KV_TIMEOUT_MS = 6000
SHM = {"cache_transceiver_config": {"backend": "shm", "kv_transfer_timeout_ms": KV_TIMEOUT_MS}}
HND16 = {**SHM, "kv_layout": "HND", "tokens_per_block": 16}
NHD16 = {**HND16, "kv_layout": "NHD"}
TP2, PP2 = {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}


@pytest.fixture(scope="module")
def shm_group(tiny_kv2, e2e_dir, plain):
    specs = [
        Spec("shm-tp1", tiny_kv2, HND16),
        Spec("shm-tp2", tiny_kv2, {**HND16, **TP2, "max_num_tokens": 24,
                                   "cache_transceiver_config": {**SHM["cache_transceiver_config"],
                                                                "pipelined_transfer": True}}),
        Spec("shm-pp2", tiny_kv2, {**HND16, **PP2}),
        Spec("shm-tp2pp2", tiny_kv2, {**HND16, **TP2, **PP2}),
        Spec("shm-tp4", tiny_kv2, {**HND16, "tensor_parallel_size": 4}),  # 2 KV heads, each on 2 ranks
        Spec("shm-tp1-tpb32", tiny_kv2, {**HND16, "tokens_per_block": 32}),
        Spec("shm-tp1-nhd", tiny_kv2, NHD16),
        Spec("shm-tp2pp2-nhd", tiny_kv2, {**NHD16, **TP2, **PP2}),
    ]
    insts = start_instances(specs, e2e_dir / "shm", TINY_BASE)
    yield insts
    stop_instances(insts.values())


PAIRS = [("shm-tp2", "shm-tp1"), ("shm-tp1", "shm-tp2"), ("shm-tp2", "shm-pp2"), ("shm-pp2", "shm-tp2"),
         ("shm-tp2pp2", "shm-tp1"), ("shm-tp4", "shm-tp1"), ("shm-tp2", "shm-tp4"), ("shm-tp2", "shm-tp1-tpb32"),
         ("shm-tp2pp2-nhd", "shm-tp1-nhd")]


@pytest.mark.parametrize("ctx,gen", PAIRS, ids=[f"{c}->{g}" for c, g in PAIRS])
def test_pair_equals_aggregated(shm_group, reference_kv2, e2e_dir, ctx, gen):
    check_split(shm_group, ctx, gen, reference_kv2, e2e_dir / "shm")


GEN_FIRST = [("shm-tp2", "shm-tp1"), ("shm-tp2", "shm-tp4"), ("shm-pp2", "shm-tp2")]


@pytest.mark.parametrize("ctx,gen", GEN_FIRST, ids=[f"{c}->{g}" for c, g in GEN_FIRST])
def test_generation_first_equals_aggregated(shm_group, reference_kv2, e2e_dir, ctx, gen):
    check_split(shm_group, ctx, gen, reference_kv2, e2e_dir / "shm", schedule_style="generation_first")


def _mismatched_request(shm_group, e2e_dir) -> httpx.Response:
    with Orchestrator(shm_group["shm-tp2"].url, shm_group["shm-tp1-nhd"].url, e2e_dir / "shm", "hnd-nhd") as orch:
        return httpx.post(orch.url + "/v1/completions", timeout=60,
                          json={"model": MODEL_NAME, "prompt": list(PROMPT_IDS), "max_tokens": 4, "temperature": 0})


def test_layout_mismatch_frees_the_context_blocks_promptly(shm_group, e2e_dir):
    """The generation side refuses the pair and cancels at once: the context side must not hold the
    request's blocks until its kv_transfer_timeout_ms."""
    assert _mismatched_request(shm_group, e2e_dir).status_code == 503
    shm_group["shm-tp2"].wait_blocks_free(timeout=3.0)


def test_layout_mismatch_is_refused_and_leaks_nothing(shm_group, e2e_dir):
    r = _mismatched_request(shm_group, e2e_dir)
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "HND" in message and "NHD" in message and "configure the same KV layout" in message, message
    shm_group["shm-tp1-nhd"].wait_blocks_free(timeout=5.0)
    # At the latest when its transfer times out, the context instance frees the request's KV.
    shm_group["shm-tp2"].wait_blocks_free(timeout=KV_TIMEOUT_MS / 1000 + 10)


def test_logprobs_cover_the_context_token(shm_group, e2e_dir, reference_kv2):
    with Orchestrator(shm_group["shm-tp2"].url, shm_group["shm-tp1"].url, e2e_dir / "shm", "logprobs") as orch:
        out = orch.client().completions.create(model=MODEL_NAME, prompt=list(PROMPT_IDS), max_tokens=6, logprobs=1,
                                               temperature=0.0, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens == 6, lp
