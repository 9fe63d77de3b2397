"""Hybrid models (Qwen3.5: Gated DeltaNet + attention; Nemotron-H: Mamba2 + attention) disaggregated across layouts, through
`pdserve disaggregated` and the official openai client, over shm (Qwen3.5) and NIXL (Nemotron-H): greedy output equals one aggregated instance
token for token, and neither side keeps a KV block or a state slot afterwards.

The recurrent state moves with the KV: each conv section ([q | k | v]) and the SSM state are re-cut by
heads between TP1 and TP2 (MapperKind.SECTIONED), and between TP2 and PP2 each stage's recurrent layers
take theirs. The TP2 context instance prefills in 24-token chunks and ships each chunk's blocks as it
goes (pipelined), the state with the last piece only."""

from __future__ import annotations

import re

import httpx
import pytest
from e2e_checks import Reference, check_split
from e2e_cluster import MODEL_NAME, TINY_BASE, Orchestrator, Spec, openai_client, start_instances, stop_instances

from pdserve.testing import make_tiny_model
from pdserve.testing.tiny_nemotron_h import make_tiny_nemotron_h

SHM = {"cache_transceiver_config": {"backend": "shm", "kv_transfer_timeout_ms": 6000}, "tokens_per_block": 16}
NIXL = {"cache_transceiver_config": {"backend": "nixl"}, "tokens_per_block": 16}
TP2 = {"tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def hybrid_group(e2e_dir):
    model = str(make_tiny_model(e2e_dir / "tiny-qwen3_5", arch="qwen3_5", num_layers=8, num_heads=4,
                                num_kv_heads=2, head_dim=16, max_position_embeddings=1024))
    specs = [
        Spec("hybrid-plain", model),
        Spec("hybrid-tp1", model, SHM),
        Spec("hybrid-tp2", model, {**SHM, **TP2, "max_num_tokens": 24,
                                   "cache_transceiver_config": {**SHM["cache_transceiver_config"],
                                                                "pipelined_transfer": True}}),
        Spec("hybrid-pp2", model, {**SHM, "pipeline_parallel_size": 2}),
    ]
    insts = start_instances(specs, e2e_dir / "hybrid", TINY_BASE)
    yield insts
    stop_instances(insts.values())


@pytest.fixture(scope="module")
def hybrid_reference(hybrid_group) -> Reference:
    return Reference(openai_client(hybrid_group["hybrid-plain"].url))


PAIRS = [("hybrid-tp1", "hybrid-tp2"), ("hybrid-tp2", "hybrid-tp1"), ("hybrid-tp2", "hybrid-pp2")]


@pytest.mark.parametrize("ctx,gen", PAIRS, ids=[f"{c}->{g}" for c, g in PAIRS])
def test_pair_equals_aggregated(hybrid_group, hybrid_reference, e2e_dir, ctx, gen):
    check_split(hybrid_group, ctx, gen, hybrid_reference, e2e_dir / "hybrid")


def test_generation_first_equals_aggregated(hybrid_group, hybrid_reference, e2e_dir):
    check_split(hybrid_group, "hybrid-tp2", "hybrid-tp1", hybrid_reference, e2e_dir / "hybrid",
                schedule_style="generation_first")


@pytest.fixture(scope="module")
def nemotron_group(e2e_dir):
    """Nemotron-H over NIXL (Qwen3.5's pairs above go over shm): the Mamba2 conv state's [x | B | C] sections
    cut by heads (x) and groups (B, C)."""
    model = str(make_tiny_nemotron_h(e2e_dir / "tiny-nemotron_h", pattern="M-*-M-M*", max_position_embeddings=1024))
    specs = [Spec("nemotron-plain", model), Spec("nemotron-tp1", model, NIXL),
             Spec("nemotron-tp2", model, {**NIXL, **TP2})]
    insts = start_instances(specs, e2e_dir / "nemotron", TINY_BASE)
    yield insts
    stop_instances(insts.values())


@pytest.mark.parametrize("ctx,gen", [("nemotron-tp1", "nemotron-tp2"), ("nemotron-tp2", "nemotron-tp1")],
                         ids=["tp1->tp2", "tp2->tp1"])
def test_nemotron_h_pair_equals_aggregated(nemotron_group, e2e_dir, ctx, gen):
    reference = Reference(openai_client(nemotron_group["nemotron-plain"].url))
    check_split(nemotron_group, ctx, gen, reference, e2e_dir / "nemotron")


def _n_choices_split_equal_aggregated(group: dict, plain: str, ctx: str, gen: str, workdir) -> None:
    """A seeded n = 3 chat through `pdserve disaggregated` (context_first), whole and streamed: the context
    instance draws every choice's first token, one transfer moves the prompt's KV and recurrent state, and the
    generation instance forks choices 1..n-1 from it (a copy of the state slot each): the same choices as one
    aggregated instance, and no block or state slot left on either side."""
    body = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Count on"}], max_tokens=8, n=3,
                temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    want = [c.message.content for c in openai_client(group[plain].url).chat.completions.create(**body).choices]
    assert len(set(want)) > 1
    with Orchestrator(group[ctx].url, group[gen].url, workdir, f"n-choices-{ctx}") as orch:
        got = orch.client().chat.completions.create(**body)
        streamed = ["", "", ""]
        for chunk in orch.client().chat.completions.create(**body, stream=True):
            for c in chunk.choices:
                streamed[c.index] += c.delta.content or ""
        split = re.search(r'^pdserve_orchestrator_requests_total\{path="disaggregated"\} (\S+)$',
                          httpx.get(orch.url + "/metrics", timeout=5).text, re.M)
    assert [c.message.content for c in got.choices] == want
    assert streamed == want
    assert split and float(split.group(1)) == 2  # both went through the context instance
    for name in (ctx, gen):
        group[name].wait_blocks_free()


def test_n_choices_split_equal_aggregated(hybrid_group, e2e_dir):
    _n_choices_split_equal_aggregated(hybrid_group, "hybrid-plain", "hybrid-tp1", "hybrid-tp2", e2e_dir / "hybrid")


def test_n_choices_under_generation_first_are_served_whole(hybrid_group, e2e_dir):
    """generation_first carries one first token with the KV: n > 1 is served whole on the generation instance,
    with the aggregated choices, and the context instance never sees it."""
    body = dict(model=MODEL_NAME, prompt="Count on", max_tokens=8, n=3, temperature=1.0, seed=5,
                extra_body={"ignore_eos": True})
    want = [c.text for c in openai_client(hybrid_group["hybrid-plain"].url).completions.create(**body).choices]
    with Orchestrator(hybrid_group["hybrid-tp1"].url, hybrid_group["hybrid-tp2"].url, e2e_dir / "hybrid",
                      "n-choices-generation-first", schedule_style="generation_first") as orch:
        got = [c.text for c in orch.client().completions.create(**body).choices]
        local = re.search(r'^pdserve_orchestrator_requests_total\{path="local"\} (\S+)$',
                          httpx.get(orch.url + "/metrics", timeout=5).text, re.M)
    assert got == want and len(set(want)) > 1
    assert local and float(local.group(1)) == 1


def test_nemotron_h_n_choices_split_equal_aggregated(nemotron_group, e2e_dir):
    _n_choices_split_equal_aggregated(nemotron_group, "nemotron-plain", "nemotron-tp2", "nemotron-tp1",
                                      e2e_dir / "nemotron")
