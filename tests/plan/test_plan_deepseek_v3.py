"""`pdserve plan` on a DeepSeek-V3 directory: the KV it prices is MLA's latent, as the engine's own page table
has it (one 40-wide latent per token and layer: 480 fp32 bytes a token, a quarter of per-head K and V).

The profile is measured as `pdserve plan` measures it, on a tiny model of a 256-token window (so the profile's
own grid is small): the engine's forward steps at one thread in a spawned child (profile._step_timings), and KV
writes through the shm agent in fragments of 32 tokens of latents (profile._transfer_timings). Only the
two-thread steps and the serving probe are left out, for time (test_plan_cli.py runs them on a tiny Llama): the
plan then places one-thread instances only. `pdserve plan` reads that profile from its cache, plans, and prints
the transfer plan of a context TP2 -> generation TP1 pair."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main
from pdserve.config import CacheTransceiverConfig, EngineConfig
from pdserve.engine.llm import LLM
from pdserve.models.config import ModelConfig
from pdserve.plan.candidates import enumerate_candidates
from pdserve.plan.costmodel import step_costs, transfer_costs
from pdserve.plan.measurements import Profile, StepTimings
from pdserve.plan.profile import (_grid, _in_child, _step_timings, _transfer_timings, cache_path, load_or_measure,
                                  model_sizes, profile_key, usable_cores)
from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3
from pdserve.weights.hf_dir import read_config

pytestmark = pytest.mark.skipif(len(usable_cores()) < 2, reason="a disaggregated candidate needs two cores")

LATENT_TOKEN = 3 * (32 + 8) * 4  # layers x (kv_lora + rope) x fp32 bytes


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return make_tiny_deepseek_v3(tmp_path_factory.mktemp("ds") / "m", max_position_embeddings=256)


@pytest.fixture
def profiled(ds, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    sizes = model_sizes(ModelConfig.from_hf(read_config(ds)), "float32")
    grid = _grid(sizes["max_model_len"], sizes["kv_bytes_per_token"])
    steps = StepTimings.from_dict(_in_child(_step_timings, str(ds), "float32", "cpu", 1, grid, False))
    transfer = _transfer_timings(sizes["kv_bytes_per_token"], grid["transfer_mb"][:2], False)
    key = profile_key(ds, "float32", "cpu")
    profile = Profile(key, sizes, {1: steps}, transfer)
    path = cache_path(key)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(profile.to_dict()))
    return profile


def _page_table_bytes_per_token(ds) -> tuple[int, set[str]]:
    """Bytes a block of the engine's real page table carries, per token, and its pools' mapper kinds."""
    tc = CacheTransceiverConfig(backend="shm")
    with LLM(EngineConfig(model=str(ds), tokens_per_block=32, num_kv_blocks=4, cache_transceiver_config=tc)) as llm:
        table = llm.engine.runner.connector.info.page_table
    per_block = sum(e.size for g in table.layer_groups if not g.recurrent for v in g.views for e in v.entries)
    kinds = {table.kind_of(v).name for g in table.layer_groups for v in g.views}
    return per_block // table.tokens_per_block, kinds


def test_the_plan_prices_the_latent_of_the_real_page_table(ds, profiled, tmp_path, capsys):
    per_token, kinds = _page_table_bytes_per_token(ds)
    assert per_token == LATENT_TOKEN and kinds == {"REPLICATED"}
    assert profiled.model["kv_bytes_per_token"] == per_token and profiled.model["latent"]
    # the writes were timed in fragments of one 32-token block of latents
    assert all(n % (32 * per_token) == 0 and s > 0 for n, s in profiled.transfer["shm"])
    assert min(profiled.steps[1].prefill.values()) > 0 and len(profiled.steps[1].decode) >= 5

    out = tmp_path / "out"
    out.mkdir()
    rc = main(["plan", "--model", str(ds), "--slo", "ttft:2000,tpot:200", "--input-len", "200", "--output-len", "8",
               "--num-requests", "20", "--ctx-layout", "tp2", "--gen-layout", "1", "--out", str(out / "c.yaml"),
               "--json", str(out / "plan.json")])
    printed = capsys.readouterr().out
    assert rc == 0 and "(cached:" in printed  # the profile above, not a new one
    doc = json.loads((out / "plan.json").read_text())
    assert any(c["kind"] == "disaggregated" for c in doc["candidates"])
    # the preview: one elected context rank writes the generation rank 224 tokens (7 blocks) of latents
    plan = printed[printed.index("KV transfer plan"):]
    owners = [line.split() for line in plan.splitlines() if line.split()[2:3] == ["yes"]]
    assert len(owners) == 1 and str(224 * per_token) in owners[0] and "REPLICATED" in owners[0], plan
    # the simulated transfer of a request: its tokens of latents over the measured shm line
    profile, _, fresh = load_or_measure(str(ds), progress=False)
    assert not fresh
    costs, shm = step_costs(profile), transfer_costs(profile)["shm"]
    cand = next(c for c in enumerate_candidates(profile.units, 2, 200, 200.0) if c.kind == "disaggregated")
    dep = cand.deployment(costs, shm, profile.kv_bytes_per_token)
    assert dep.kv_bytes_per_token == per_token  # what simulate() moves: 200 x 480 bytes over the shm line
