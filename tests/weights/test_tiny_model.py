"""Tiny random-weight models: real HF directories that transformers loads and decodes non-trivially."""

import hashlib
import json

import pytest
import torch
from tokenizers import Tokenizer

from pdserve.testing import build_tiny_tokenizer, make_tiny_model
from pdserve.weights.hf_dir import read_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _greedy(model_dir, prompt_ids, n=32):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tied", [False, True])
def test_transformers_loads_and_decodes_varied_tokens(tmp_path, arch, tied):
    d = make_tiny_model(tmp_path / "m", arch=arch, tie_word_embeddings=tied)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    prompt = tok("The capital of France is").input_ids
    out = _greedy(d, prompt)
    assert len(out) == 32
    # Random weights at the usual 0.02 init give one token forever; ours must vary.
    assert len(set(out)) >= 5, out
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "mistral": "MistralForCausalLM"}[arch]
    assert model.config.tie_word_embeddings == tied
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_same_arguments_same_bytes(tmp_path):
    digests = []
    for name in ("a", "b"):
        d = make_tiny_model(tmp_path / name, num_layers=3, num_heads=6, num_kv_heads=3, seed=7)
        digests.append({f: hashlib.sha256((d / f).read_bytes()).hexdigest()
                        for f in ("model.safetensors", "tokenizer.json", "config.json")})
    assert digests[0] == digests[1]
    other = make_tiny_model(tmp_path / "c", num_layers=3, num_heads=6, num_kv_heads=3, seed=8)
    assert hashlib.sha256((other / "model.safetensors").read_bytes()).hexdigest() != digests[0]["model.safetensors"]


def test_geometry_and_files(tmp_path):
    d = make_tiny_model(tmp_path / "m", num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8,
                        hidden_size=36, intermediate_size=24, vocab_size=300, dtype=torch.bfloat16)
    cfg = read_config(d)
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (3, 6, 2)
    assert (cfg["head_dim"], cfg["hidden_size"], cfg["vocab_size"]) == (8, 36, 300)
    assert Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size() == 300
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert "chat_template" in tok_cfg and tok_cfg["eos_token"] == "<|im_end|>"
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 2
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (48, 36)
    assert model.model.layers[0].self_attn.k_proj.weight.dtype == torch.bfloat16
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    assert out.shape == (1, 7)


def test_llama3_rope_scaling_reaches_transformers(tmp_path):
    plain = make_tiny_model(tmp_path / "plain", max_position_embeddings=512)
    scaled = make_tiny_model(tmp_path / "scaled", rope_scaling=LLAMA3_SCALING, max_position_embeddings=512)
    model_p = transformers.AutoModelForCausalLM.from_pretrained(plain)
    model_s = transformers.AutoModelForCausalLM.from_pretrained(scaled)
    assert model_s.config.rope_parameters["rope_type"] == "llama3"
    ids = torch.arange(3, 3 + 100).unsqueeze(0)
    with torch.no_grad():
        lp, ls = model_p(ids).logits, model_s(ids).logits
    # Same weights; only the rotary frequencies differ, so position 0 agrees and later ones do not.
    torch.testing.assert_close(lp[0, 0], ls[0, 0])
    assert not torch.allclose(lp[0, -1], ls[0, -1], atol=1e-3)


def test_tokenizer_round_trips_and_is_byte_level():
    tok = build_tiny_tokenizer(512)
    assert tok.get_vocab_size() == 512
    for text in ["hello world", "日本語 🙂 ✓", "def f(x):\n\treturn x**2  # ok", ""]:
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode("<|im_start|>user").ids[0] == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_heads": 6, "num_kv_heads": 4}, "multiple of num_kv_heads"),
        ({"vocab_size": 100}, "too small"),
        ({"arch": "gpt2"}, "unknown"),
        ({"head_dim": 7}, "even"),
        ({"hidden_size": 30}, "multiple of num_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}}, "missing"),
    ],
)
def test_bad_arguments_are_explained(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_tiny_model(tmp_path / "m", **kwargs)
