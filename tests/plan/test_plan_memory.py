"""`pdserve plan --model` a published config.json without weights: memory per rank for each TP x PP layout, from
the footprint `pdserve serve` checks before loading (engine/footprint.py), and a plain word on what it cannot do."""

from __future__ import annotations

import pytest

from pdserve.cli import main
from pdserve.config import EngineConfig
from pdserve.engine.footprint import GIB, footprint
from pdserve.models.config import ModelConfig
from pdserve.testing.published_configs import write_published_config
from pdserve.weights.hf_dir import read_config


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    return write_published_config(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3")


def row(out: str, layout: str) -> list[str]:
    return next(line for line in out.splitlines() if line.startswith(layout + " ")).split()


def test_a_bare_deepseek_v3_config_prints_memory_per_rank(deepseek_v3, capsys):
    assert main(["plan", "--model", str(deepseek_v3), "--dtype", "bfloat16", "--device", "cpu",
                 "--max-ranks", "8"]) == 0
    out = capsys.readouterr().out
    assert "61 layers, 61 keep KV: 68.6 KiB of KV a token" in out and "MLA latent 576 wide" in out
    cfg = ModelConfig.from_hf(read_config(deepseek_v3))
    weights = {}
    for tp, pp in ((1, 1), (8, 1), (4, 2)):
        fp = footprint(cfg, EngineConfig(dtype="bfloat16"), "cpu", tp=tp, pp=pp)
        r = fp.largest
        cells = row(out, f"TP{tp} PP{pp}")
        assert cells[2:5] == [str(tp * pp), f"{(r.weights + r.cpu_copies) / GIB:.2f}", f"{r.kv_pool / GIB:.2f}"]
        weights[tp, pp] = r.weights / GIB
    assert 1250 < weights[1, 1] < 1255  # 671B parameters at 2 bytes
    assert 155 < weights[8, 1] < 160  # an eighth, plus what every rank keeps whole
    assert "TP16" not in out  # --max-ranks 8
    assert "cannot rank deployments" in out and "no: memory" in out


def test_the_file_itself_plans_too_and_qwen3_moe_is_its_published_size(tmp_path, capsys):
    config = write_published_config(tmp_path, "qwen3_moe") / "config.json"
    assert main(["plan", "--model", str(config), "--dtype", "bfloat16", "--device", "cpu", "--max-ranks", "1"]) == 0
    out = capsys.readouterr().out
    assert "48 layers, 48 keep KV: 96.0 KiB of KV a token" in out  # 48 x K and V x 4 heads x 128 x 2 bytes
    fp = footprint(ModelConfig.from_hf(read_config(config.parent)), EngineConfig(dtype="bfloat16"), "cpu")
    assert 56 < fp.ranks[0].weights / GIB < 58  # 30.5B parameters at 2 bytes
    assert row(out, "TP1 PP1")[3] == f"{(fp.ranks[0].weights + fp.ranks[0].cpu_copies) / GIB:.2f}"


def test_ranking_still_needs_an_slo(capsys):
    assert main(["plan"]) == 2
    assert "--slo ttft:MS,tpot:MS is required" in capsys.readouterr().err


def test_a_plan_leaves_out_deployments_whose_instances_the_host_cannot_hold(tmp_path):
    """With weights, the ranked plan keeps only the candidates `pdserve launch` would start: their instances'
    memory added up (launch/config.py, too_big_for_memory) within what the host has."""
    from pdserve.plan.cli import build_parser
    from pdserve.plan.candidates import enumerate_candidates
    from pdserve.plan.measurements import Profile
    from pdserve.plan.run import fitting
    from pdserve.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "m", num_layers=2)
    args = build_parser().parse_args(["--slo", "ttft:1000,tpot:100", "--backend", "shm"])
    profile = Profile({"model": str(model), "device": "cpu", "units": 2}, {}, {})  # the model is the profile's
    candidates = enumerate_candidates([1, 2], 2, 256)
    one = footprint(ModelConfig.from_hf(read_config(model)), EngineConfig(), "cpu").total  # a generation instance
    kept, why = fitting(candidates, args, profile, available=int(1.5 * one))
    assert {c.name.split("-")[0] for c in kept} == {"agg1x2"}  # one instance: the two-instance ones need ~2x
    assert why.startswith("agg2x1-c256: the instances on this host's CPU need") and "gen1" in why
    kept, why = fitting(candidates, args, profile, available=3 * one)
    assert kept == candidates and why is None


def test_a_hybrid_model_counts_its_recurrent_state(tmp_path, capsys):
    """NVIDIA-Nemotron-Nano-9B-v2's sizes: 27 Mamba2 layers keep 136.9 MiB of state a request (conv inputs in
    bf16, SSM state fp32), allocated up front for every one of max_num_seqs (64) slots."""
    d = write_published_config(tmp_path, "nemotron_h")
    assert main(["plan", "--model", str(d), "--dtype", "bfloat16", "--device", "cpu", "--max-ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "56 layers, 4 keep KV: 16.0 KiB of KV a token" in out and "recurrent state 136.9 MiB a request" in out
    fp = footprint(ModelConfig.from_hf(read_config(d)), EngineConfig(dtype="bfloat16"), "cpu", tp=2)
    assert row(out, "TP2 PP1")[5] == f"{fp.largest.state / GIB:.2f}"
    assert abs(fp.largest.state * 2 / 64 / 2**20 - 136.9) < 0.05  # TP2 halves each slot
