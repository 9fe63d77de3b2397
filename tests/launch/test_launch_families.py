"""Every family as its publisher ships it (pdserve/testing/published_families.py: transformers' save_pretrained
of the published class, bf16, sharded by a model.safetensors.index.json) served by `pdserve launch`, context TP1
-> generation TP2, gives transformers' greedy tokens, token id for token id (the prompt sent as ids, the answer's
ids streamed back by return_token_ids). On the way each family's weights and cache are cut across TP: attention
by KV heads (Llama, Qwen2, Qwen3, Qwen3-MoE, Nemotron-H; every expert by its intermediate dimension),
Nemotron-H's Mamba2 state by heads and its conv state section by section, DeepSeek-V3's latent (the same on
every TP rank) sent to both generation ranks whole, in bf16 and in FP8 blocks (with the MTP layer DeepSeek
ships, skipped). Qwen3-MoE also goes the other way, context TP2 -> generation TP1: of the two TP2 -> TP1 cases
this module held before (Qwen3, Qwen3-MoE), the one that cuts experts too. Qwen3.5 is served from
its vision-language checkpoints (dense and MoE, the vision tower skipped), its Gated DeltaNet state re-cut by
heads on the way, and Nemotron-H with Nemotron 3's MoE layers too.

`pdserve launch` starts every instance as `pdserve serve --config FILE` (launch/local.py), the same `_serve`,
engine and loader as `pdserve serve DIR`, whose positional DIR only fills the same WorkerConfig.model: a launch
covers serve's loading, and a `pdserve serve DIR` process a family (about 14 s of CPU each, a launch about 31 s)
would repeat it. The real `pdserve serve DIR` of a sharded published checkpoint is tests/engine/test_engine_qwen3.py's
(Qwen3 and Qwen3-MoE, saved by transformers in shards).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from openai import OpenAI

from pdserve.host import free_port
from pdserve.testing.published_families import FAMILIES, oracle_dir
from pdserve.testing.wait import reaped, stop_cleanly, wait_for_line
from pdserve.weights.hf_dir import INDEX_FILE

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SMALL_POOL = {"tokens_per_block": 8, "kv_cache_memory_gb": 0.0625}
PROMPT = [5, 9, 33, 70, 2, 101, 17, 250, 44, 3]  # ten tokens: one whole block of 8 and a partial one
MAX_NEW = 8


@pytest.fixture(scope="module")
def published(tmp_path_factory, hf_greedy):
    """name -> (checkpoint directory, transformers' greedy tokens on it), each written once per module."""
    done: dict[str, tuple[Path, list[int]]] = {}

    def get(name: str) -> tuple[Path, list[int]]:
        if name not in done:
            d = FAMILIES[name](tmp_path_factory.mktemp("published") / name, "40KB")
            shards = set(json.loads((d / INDEX_FILE).read_text())["weight_map"].values())
            assert len(shards) > 1 and all((d / s).exists() for s in shards)
            published_class = getattr(transformers, json.loads((d / "config.json").read_text())["architectures"][0])
            model = published_class.from_pretrained(oracle_dir(d), dtype=torch.float32)
            done[name] = d, hf_greedy(model, [PROMPT], MAX_NEW)[0]
        return done[name]
    return get


def _greedy_ids(base_url: str, model: str) -> list[int]:
    client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    return [t for chunk in stream for choice in chunk.choices for t in (choice.model_extra or {}).get("token_ids", [])]


@pytest.mark.parametrize("name,ctx_tp,gen_tp", [(name, 1, 2) for name in FAMILIES] + [("qwen3_moe", 2, 1)])
def test_launch_serves_the_published_family_as_transformers_does(tmp_path, published, name, ctx_tp, gen_tp):
    model, want = published(name)
    port = free_port()
    cluster = {"model": str(model), "port": port, "log_dir": str(tmp_path / "logs"), "backend": "shm",
               "context": [{"port": free_port(), "config": {**SMALL_POOL, "tensor_parallel_size": ctx_tp}}],
               "generation": [{"port": free_port(), "config": {**SMALL_POOL, "tensor_parallel_size": gen_tp}}]}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "launch", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    with reaped(proc):
        wait_for_line(proc, "ready: OpenAI API", timeout=180)
        assert _greedy_ids(f"http://127.0.0.1:{port}", model.name) == want
        assert "stopped." in stop_cleanly(proc)

