"""The memory footprint known before loading (engine/footprint.py) equals what loading takes: each rank's
parameters and buffers after `load_weights` of a tiny checkpoint of each family (and of an FP8 one, counted at
the serving dtype), at TP1, TP2 and PP2, and the KV and state pools a ModelRunner-sized engine allocates."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.footprint import footprint, state_bytes_per_slot
from pdserve.engine.model_runner import model_class
from pdserve.models.config import ModelConfig
from pdserve.models.loader import load_weights
from pdserve.parallel.state import ParallelState
from pdserve.testing.fp8_checkpoint import make_tiny_deepseek_v3_fp8
from pdserve.testing.tiny import make_tiny_model
from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3
from pdserve.testing.tiny_nemotron_h import make_tiny_nemotron_h
from pdserve.weights.hf_dir import read_config

MAX_LEN = 256


def loaded_bytes(model_dir, cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype) -> int:
    """Parameters and buffers of one rank's stage once its weights are read."""
    model = model_class(cfg)(cfg, ps, dtype, MAX_LEN)
    load_weights(model, model_dir)
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


WRITERS = {
    "llama-tied": lambda d: make_tiny_model(d, num_layers=3, tie_word_embeddings=True),
    "qwen3_moe": lambda d: make_tiny_model(d, arch="qwen3_moe", num_layers=3),
    "qwen3_5": lambda d: make_tiny_model(d, arch="qwen3_5", num_layers=4),
    "deepseek_v3": lambda d: make_tiny_deepseek_v3(d, num_layers=3),
    "nemotron_h": lambda d: make_tiny_nemotron_h(d),
    # FP8 [16, 24] blocks and an MTP layer: dequantized at load to the serving dtype, the MTP layer skipped
    "deepseek_v3_fp8": lambda d: make_tiny_deepseek_v3_fp8(d, num_layers=3)[0],
}


@pytest.fixture(scope="module", params=list(WRITERS))
def tiny(request, tmp_path_factory):
    d = WRITERS[request.param](tmp_path_factory.mktemp(request.param))
    return d, ModelConfig.from_hf(read_config(d))


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_weights_per_rank_equal_the_loaded_ones(tiny, tp, pp):
    model_dir, cfg = tiny
    ecfg = EngineConfig(dtype="bfloat16", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                        cpu_decode_gemv=False)
    fp = footprint(cfg, ecfg, "cpu", MAX_LEN)
    assert [r.rank for r in fp.ranks] == list(range(tp * pp))
    for r in fp.ranks:
        assert r.weights == loaded_bytes(model_dir, cfg, ParallelState(tp, pp, r.rank), torch.bfloat16), r
        assert r.cpu_copies == 0


def test_replicated_experts_count_whole_on_every_rank(tmp_path):
    d = make_tiny_model(tmp_path, arch="qwen3_moe", num_layers=2)
    cfg = ModelConfig.from_hf(read_config(d))
    sharded = footprint(cfg, EngineConfig(tensor_parallel_size=2), "cuda", MAX_LEN)
    replicated = footprint(cfg, EngineConfig(tensor_parallel_size=2, moe_experts="replicated"), "cuda", MAX_LEN)
    from dataclasses import replace

    whole = replace(cfg, moe=replace(cfg.moe, replicated=True))
    assert replicated.ranks[1].weights == loaded_bytes(d, whole, ParallelState(2, 1, 1), torch.float32)
    assert replicated.ranks[1].weights > sharded.ranks[1].weights


def test_the_pools_equal_the_engines(tiny):
    """KV pool and recurrent state as an engine allocates them (LLMEngine on this checkpoint, TP1)."""
    from pdserve.engine.llm_engine import LLMEngine

    model_dir, cfg = tiny
    ecfg = EngineConfig(model=str(model_dir), kv_cache_memory_gb=0.002, max_num_seqs=4, max_model_len=MAX_LEN,
                        cpu_decode_gemv=False, device="cpu")
    fp = footprint(cfg, ecfg, "cpu", MAX_LEN)
    engine = LLMEngine(ecfg)
    try:
        runner = engine.runner
        assert fp.num_kv_blocks == runner.num_blocks
        pool_rows = runner.pool.shape[0]
        assert fp.ranks[0].kv_pool == runner.pool.numel() * runner.pool.element_size() // pool_rows * runner.num_blocks
        state = runner.model.state if runner.num_state_slots else None
        got = 0 if state is None else state.conv.nbytes + state.ssm.nbytes
        assert fp.ranks[0].state == got
        assert (got > 0) == (state_bytes_per_slot(cfg, 1, torch.float32) > 0)
    finally:
        engine.shutdown()


def test_cpu_copies_are_the_linear_weights_once_more(tmp_path):
    from pdserve.models.layers import onednn_packs

    if not onednn_packs(torch.float32):
        pytest.skip("oneDNN does not pack float32 here: no second copy")
    d = make_tiny_model(tmp_path, num_layers=2)
    cfg = ModelConfig.from_hf(read_config(d))
    fp = footprint(cfg, EngineConfig(), "cpu", MAX_LEN)
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linears = cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * i) * 4
    assert fp.ranks[0].cpu_copies == linears
    assert footprint(cfg, EngineConfig(), "cuda", MAX_LEN).ranks[0].cpu_copies == 0


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), num_layers=2)


def refusal(monkeypatch, ecfg: EngineConfig) -> str:
    """LLMEngine's error for `ecfg`, with a witness that no weight was read first."""
    import pdserve.engine.model_runner as model_runner
    from pdserve.engine.llm_engine import LLMEngine

    reads = []
    monkeypatch.setattr(model_runner, "load_weights", lambda *a, **k: reads.append(a))
    with pytest.raises(ValueError) as e:
        LLMEngine(ecfg)
    assert reads == []
    return str(e.value)


def test_a_model_that_does_not_fit_is_refused_before_loading_naming_a_layout_that_fits(llama_dir, monkeypatch):
    base = dict(model=str(llama_dir), device="cpu", kv_cache_memory_gb=0.01, max_model_len=MAX_LEN)
    cfg = ModelConfig.from_hf(read_config(llama_dir))
    tp2 = footprint(cfg, EngineConfig(**base, tensor_parallel_size=2), "cpu", MAX_LEN)
    tp1 = footprint(cfg, EngineConfig(**base), "cpu", MAX_LEN)
    assert tp1.total < tp2.total
    limit = (tp1.total + tp2.total) / 2 / 2**30  # TP1 fits, TP2 (two KV pools on this host) does not
    why = refusal(monkeypatch, EngineConfig(**base, tensor_parallel_size=2, memory_limit_gb=limit))
    r = tp2.largest
    assert f"weights {r.weights / 2**30:.2f} GiB" in why and f"KV pool {r.kv_pool / 2**30:.2f} GiB" in why
    assert f"2 rank(s) {tp2.total / 2**30:.2f} GiB together; they share this host, which has {limit:.2f} GiB " \
           "available" in why
    assert "tensor_parallel_size=1, pipeline_parallel_size=1 fits" in why and "memory_limit_gb" in why


def test_when_no_layout_fits_the_refusal_says_so(llama_dir, monkeypatch):
    why = refusal(monkeypatch, EngineConfig(model=str(llama_dir), device="cpu", memory_limit_gb=0.001))
    assert "No TP / PP of up to" in why and "lower kv_cache_memory_gb" in why and "serve in bfloat16" in why


def test_a_model_that_fits_loads(llama_dir):
    from pdserve.engine.llm_engine import LLMEngine

    ecfg = EngineConfig(model=str(llama_dir), device="cpu", kv_cache_memory_gb=0.01, max_model_len=MAX_LEN)
    fp = footprint(ModelConfig.from_hf(read_config(llama_dir)), ecfg, "cpu", MAX_LEN)
    engine = LLMEngine(ecfg.model_copy(update={"memory_limit_gb": fp.total * 1.01 / 2**30}))
    engine.shutdown()


def test_the_check_costs_a_server_start_no_dynamo_import(llama_dir, tmp_path):
    """Built on `torch.device("meta")`, the RoPE tables ran as meta ops, whose Python kernels imported
    torch._dynamo: 2-3 s of every server's start on this machine."""
    import pickle
    import subprocess
    import sys

    (tmp_path / "cfg.pkl").write_bytes(pickle.dumps(ModelConfig.from_hf(read_config(llama_dir))))  # no transformers
    code = ("import pickle, sys; from pdserve.config import EngineConfig; "
            "from pdserve.engine.footprint import memory_problem; "
            f"cfg = pickle.loads(open({str(tmp_path / 'cfg.pkl')!r}, 'rb').read()); "
            "assert memory_problem(cfg, EngineConfig(), 'cpu', 1 << 40, 2) is None; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
