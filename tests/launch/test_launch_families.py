"""`pdserve launch` of the families beyond Llama: a cluster from one command whose disaggregated answer equals
one aggregated engine's. Qwen3 and Qwen3-MoE go context TP2 -> generation TP1 (attention cut by heads, every
expert by its intermediate dimension), Qwen3.5 TP1 -> TP2 (its recurrent state re-cut by heads on the way),
DeepSeek-V3 TP1 -> TP2 (its latent cache, the same on every TP rank, sent to both generation ranks whole);
tests/disagg_e2e holds more pairs of each through workers and an orchestrator."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from openai import OpenAI

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.host import free_port
from pdserve.testing import make_tiny_model
from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3
from pdserve.testing.wait import reaped, stop_cleanly, wait_for_line

SMALL_POOL = {"tokens_per_block": 8, "kv_cache_memory_gb": 0.0625}


@pytest.mark.parametrize("arch,ctx_tp,gen_tp", [("qwen3", 2, 1), ("qwen3_moe", 2, 1), ("qwen3_5", 1, 2),
                                                 ("deepseek_v3", 1, 2)])
def test_launch_serves_the_family_disaggregated(tmp_path, arch, ctx_tp, gen_tp):
    if arch == "deepseek_v3":
        model = str(make_tiny_deepseek_v3(tmp_path / "m"))
    else:
        model = str(make_tiny_model(tmp_path / "m", arch=arch, num_layers=3 if arch != "qwen3_5" else 4, num_heads=4,
                                    num_kv_heads=2, head_dim=16))
    port = free_port()
    cluster = {"model": model, "port": port, "log_dir": str(tmp_path / "logs"), "backend": "shm",
               "context": [{"port": free_port(), "config": {**SMALL_POOL, "tensor_parallel_size": ctx_tp}}],
               "generation": [{"port": free_port(), "config": {**SMALL_POOL, "tensor_parallel_size": gen_tp}}]}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "launch", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    with reaped(proc):
        wait_for_line(proc, "ready: OpenAI API", timeout=180)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        prompt = "The quick brown fox jumps over the lazy dog, and"
        got = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        with LLM(EngineConfig(model=model, tokens_per_block=8)) as llm:
            want = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        assert got.choices[0].text == want.text
        assert "stopped." in stop_cleanly(proc)
