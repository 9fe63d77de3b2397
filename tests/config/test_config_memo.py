"""A model's config, once read through transformers, is remembered (models/config_memo.py): the next server
process that reads an equal config.json takes pdserve's reading from the cache and never imports transformers
(about a second of every start), and it is the same reading, nested shapes and all."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.models.config import ModelConfig
from pdserve.testing import make_tiny_model
from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3
from pdserve.testing.tiny_nemotron_h import make_tiny_nemotron_h
from pdserve.weights.hf_dir import read_config

YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "mscale": 0.707,
        "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, dict]:
    """config.json of a family of each kind of shape ModelConfig nests (MLA with YaRN, MoE, Mamba2, DeltaNet)."""
    d = tmp_path_factory.mktemp("configs")
    return {"llama": read_config(make_tiny_model(d / "llama", num_layers=1)),
            "qwen3_moe": read_config(make_tiny_model(d / "moe", arch="qwen3_moe", num_layers=2)),
            "qwen3_5": read_config(make_tiny_model(d / "q35", arch="qwen3_5", num_layers=4)),
            "nemotron_h": read_config(make_tiny_nemotron_h(d / "nh", pattern="M-*")),
            "deepseek_v3": read_config(make_tiny_deepseek_v3(d / "ds", num_layers=2, rope_scaling=YARN))}


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_5", "nemotron_h", "deepseek_v3"])
def test_a_remembered_reading_is_the_reading(configs, tmp_path, family):
    first = ModelConfig.from_hf(configs[family], remember_in=tmp_path)
    (stored,) = tmp_path.iterdir()
    again = ModelConfig.from_hf(configs[family], remember_in=tmp_path)
    assert again == first == ModelConfig.from_hf(configs[family])
    assert list(tmp_path.iterdir()) == [stored]


def test_a_process_reading_a_remembered_config_does_not_import_transformers(configs, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(configs["deepseek_v3"]))
    want = ModelConfig.from_hf(configs["deepseek_v3"], remember_in=tmp_path / "memo")
    probe = ("import sys; from pdserve.models.config import ModelConfig; from pdserve.weights.hf_dir import read_config\n"
             f"cfg = ModelConfig.from_hf(read_config({str(tmp_path)!r}), remember_in=__import__('pathlib').Path("
             f"{str(tmp_path / 'memo')!r}))\n"
             "print(repr(cfg)); print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [repr(want), "False"]


def test_a_changed_config_is_read_anew_and_a_refused_one_never_remembered(configs, tmp_path):
    base = ModelConfig.from_hf(configs["llama"], remember_in=tmp_path)
    wider = ModelConfig.from_hf(configs["llama"] | {"rms_norm_eps": 1e-3}, remember_in=tmp_path)
    assert (base.rms_norm_eps, wider.rms_norm_eps) != (1e-3, 1e-3) and wider.rms_norm_eps == 1e-3
    assert len(list(tmp_path.iterdir())) == 2
    for _ in range(2):  # refused each time, as transformers' reading refuses it
        with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
            ModelConfig.from_hf(configs["llama"] | {"hidden_act": "gelu"}, remember_in=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2


def test_a_remembered_file_that_does_not_read_back_is_read_anew_and_replaced(configs, tmp_path, caplog):
    want = ModelConfig.from_hf(configs["nemotron_h"], remember_in=tmp_path)
    (stored,) = tmp_path.iterdir()
    for broken in ('{"architecture": "NemotronHForCausalLM"', '{"architecture": 3}', "[]"):
        stored.write_text(broken)
        assert ModelConfig.from_hf(configs["nemotron_h"], remember_in=tmp_path) == want
        assert "does not read back" in caplog.text
        assert json.loads(stored.read_text())["architecture"] == "NemotronHForCausalLM"
