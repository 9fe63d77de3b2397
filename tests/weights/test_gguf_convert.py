"""GGUF -> HF directory: exact tensors, transformers parity, config and tokenizer from metadata."""

import json

import numpy as np
import pytest
import torch
from gguf_writers import write_tiny_gguf
from safetensors.torch import load_file

from pdserve.weights.gguf_convert import convert_gguf, llama3_rope_scaling, unpermute_rotary
from pdserve.weights.hf_dir import open_tensors, read_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _state(d):
    return {n: t.load() for n, t in open_tensors(d).items()}


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen2"])
def test_f32_gguf_reproduces_the_original_weights_exactly(which, request, tmp_path):
    hf, f32_gguf, _ = request.getfixturevalue(which)
    out = convert_gguf(f32_gguf, tmp_path / "out", progress=False)
    original, converted = load_file(str(hf / "model.safetensors")), _state(out)
    assert converted.keys() == original.keys()
    for name in original:
        assert torch.equal(converted[name], original[name]), name  # includes un-permuted q/k
    cfg, ref_cfg = read_config(out), read_config(hf)
    for key in ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rope_theta",
                "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):
        assert cfg[key] == ref_cfg[key], key


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen2"])
def test_q8_gguf_matches_transformers_gguf_loading(which, request, tmp_path):
    hf, _, q8 = request.getfixturevalue(which)
    out = convert_gguf(q8, tmp_path / "out", progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(q8.parent, gguf_file=q8.name)
    ours = transformers.AutoModelForCausalLM.from_pretrained(out)
    a, b = ref.state_dict(), ours.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ids = torch.tensor([[5, 77, 300, 12, 9]])
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ref.generate(ids, **kw), ours.generate(ids, **kw))
    ref_tok = transformers.AutoTokenizer.from_pretrained(q8.parent, gguf_file=q8.name)
    our_tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in ["The capital of France is", "def forward(self): 2024", "<|im_start|>user\nhi<|im_end|>"]:
        assert our_tok(text).input_ids == ref_tok(text).input_ids
    msgs = [{"role": "user", "content": "hello"}]
    assert our_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_sharded_output_loads(tiny_llama, tmp_path):
    hf, f32, _ = tiny_llama
    out = convert_gguf(f32, tmp_path / "out", progress=False, max_shard_bytes=30_000)
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    original = load_file(str(hf / "model.safetensors"))
    assert torch.equal(model.state_dict()["model.layers.1.self_attn.k_proj.weight"],
                       original["model.layers.1.self_attn.k_proj.weight"])


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(6 * 8, 3)  # 6 heads, head_dim 8
    permuted = w.reshape(6, 2, 4, 3).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rotary(permuted, 6), w)
    # Row 1 of a permuted head is the first row of the second half (interleaved pairs).
    assert torch.equal(permuted[1], w[4])
    with pytest.raises(ValueError, match="divisible"):
        unpermute_rotary(torch.zeros(10, 2), 3)


def _llama3_factors(theta, head_dim, factor, low, high, ctx):
    inv = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    out = []
    for wl in 2 * np.pi / inv:
        if wl < ctx / high:
            out.append(1.0)
        elif wl > ctx / low:
            out.append(factor)
        else:
            s = (ctx / wl - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    factors = _llama3_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    assert llama3_rope_scaling(factors, 500000.0, 128, 8192) == scaling
    # End to end on a tiny model whose smoothed band is wide enough to pin the parameters.
    from pdserve.testing import make_tiny_model

    tiny_scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 32.0,
                    "original_max_position_embeddings": 8192}
    hf = make_tiny_model(tmp_path / "hf", head_dim=64, num_heads=2, num_kv_heads=1, rope_theta=10000.0,
                         rope_scaling=tiny_scaling)
    f = _llama3_factors(10000.0, 64, 4.0, 1.0, 32.0, 8192)
    path = write_tiny_gguf(hf, tmp_path / "m.gguf", quant="F32", rope_freqs=f)
    out = convert_gguf(path, tmp_path / "out", progress=False)
    assert read_config(out)["rope_scaling"] == tiny_scaling
    assert "rope_freqs.weight" not in open_tensors(out)


def test_generation_and_tokenizer_config(tiny_llama, tmp_path):
    _, f32, _ = tiny_llama
    out = convert_gguf(f32, tmp_path / "out", progress=False)
    gen = json.loads((out / "generation_config.json").read_text())
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert gen["eos_token_id"] == 2 and tok_cfg["eos_token"] == "<|im_end|>" and tok_cfg["bos_token"] == "<|im_start|>"
    assert tok_cfg["chat_template"].startswith("{% for message in messages %}")


def test_bad_inputs_are_explained(tiny_llama, tmp_path):
    hf, f32, _ = tiny_llama
    with pytest.raises(FileNotFoundError, match="not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "o1", progress=False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        convert_gguf(f32, busy, progress=False)
    weird = write_tiny_gguf(hf, tmp_path / "weird.gguf", quant="F32", pre="made-up-pre")
    with pytest.raises(NotImplementedError, match="made-up-pre"):
        convert_gguf(weird, tmp_path / "o2", progress=False)
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(f32, tmp_path / "o3", dtype=torch.int8, progress=False)


@pytest.mark.slow
def test_smollm2_tensors_and_generation_equal_transformers(smollm2_dir, smollm2_reference):
    ref, ref_tok = smollm2_reference
    ours = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    a, b = ref.state_dict(), ours.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    kw = dict(max_new_tokens=8, do_sample=False)
    out_ref, out_ours = ref.generate(ids, **kw), ours.generate(ids, **kw)
    assert torch.equal(out_ref, out_ours)
    assert "Paris" in tok.decode(out_ours[0, ids.shape[1]:])


def test_sentencepiece_gguf_tokenizer(tiny_llama, tmp_path):
    from gguf_writers import write_sentencepiece_gguf

    from pdserve.tokenizer import Tokenizer

    _, f32, _ = tiny_llama
    sp = write_sentencepiece_gguf(f32, tmp_path / "sp.gguf")
    out = convert_gguf(sp, tmp_path / "out", progress=False)
    ours = Tokenizer.from_dir(out)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=sp.name)
    # Merges were derived from scores: these must agree with transformers' derivation exactly.
    for text in ["hello world", "the and or", "héllo 🙂 x\ny", "it is on the world", ""]:
        assert ours.encode(text) == ref(text).input_ids, text
        assert ours.decode(ours.encode(text)) == text
    assert ours.encode("hello")[0] == 1  # add_bos_token
    # Leading space follows llama.cpp (a dummy space before every text fragment, so " hello" is
    # "▁" + "▁hello"), where transformers' Metaspace(prepend_scheme="first") would drop it.
    ids = ours.encode(" hello")
    assert [ours.id_to_token(i) for i in ids[1:]][:1] == ["▁"] and ours.decode(ids) == " hello"
