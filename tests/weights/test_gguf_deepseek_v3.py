"""DeepSeek-V3 GGUF files (llama.cpp's `deepseek2`). transformers has no GGUF loader for DeepSeek, so the oracle is
a round trip: a tiny HF DeepSeek-V3 directory written as a GGUF with llama.cpp's tensor names and metadata keys
(gguf_deepseek2_writer.py), converted back by pdserve (weights/gguf_deepseek2.py), and served.

- F32: the conversion gives back every tensor bit for bit (kv_b_proj joined from attn_k_b and attn_v_b, the
  score bias, the shared and the stacked experts) and the config's DeepSeek keys.
- Q8_0: served from the .gguf path, the greedy tokens equal transformers' on the HF directory with the same
  rounding applied by the gguf package itself (each weight's 32-wide row blocks quantized and dequantized where
  the file quantizes them: the K half of kv_b_proj, 16 wide in the file, stays exact)."""

import gguf
import numpy as np
import pytest
import torch
from gguf_deepseek2_writer import write_deepseek2_gguf
from safetensors.torch import load_file, save_file

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.models.config import ModelConfig
from pdserve.testing.tiny_deepseek_v3 import SHAPE, make_tiny_deepseek_v3
from pdserve.weights.gguf_convert import convert_gguf
from pdserve.weights.hf_dir import open_tensors, read_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "vocab_size", "rope_theta", "rms_norm_eps",
        "tie_word_embeddings", "rope_interleave", *SHAPE)


YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
        "beta_fast": 32.0, "beta_slow": 1.0}  # DeepSeek-V3's own kind: mscale equal to mscale_all_dim


@pytest.mark.parametrize("shape, rope_scaling", [({}, None), ({"q_lora_rank": None}, YARN)], ids=["q-lora", "yarn"])
def test_f32_gguf_gives_back_the_original_tensors_and_config(tmp_path, shape, rope_scaling):
    """With the q LoRA and plain RoPE; with one q_proj and YaRN (its keys as transformers reads them)."""
    hf = make_tiny_deepseek_v3(tmp_path / "hf", shape=shape, rope_scaling=rope_scaling)
    out = convert_gguf(write_deepseek2_gguf(hf, tmp_path / "f32.gguf", quant="F32"), tmp_path / "out", progress=False)
    original, converted = load_file(str(hf / "model.safetensors")), {n: t.load() for n, t in open_tensors(out).items()}
    assert converted.keys() == original.keys()
    for name in original:
        assert torch.equal(converted[name], original[name]), name
    cfg, ref = read_config(out), read_config(hf)
    assert {k: cfg[k] for k in KEYS} == {k: ref[k] for k in KEYS}
    if rope_scaling:
        assert {k: cfg["rope_scaling"][k] for k in YARN} == YARN
        assert ModelConfig.from_hf(cfg) == ModelConfig.from_hf(ref)  # the engine reads the same model


def _q8_0_rounded(hf, out):
    """`hf` with every weight rounded as the Q8_0 file stores it, by the gguf package's own quantizer."""
    cfg = read_config(hf)
    nope = cfg["qk_nope_head_dim"]

    def rounded(a: np.ndarray) -> np.ndarray:
        q = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.dequantize(gguf.quants.quantize(a, q), q).reshape(a.shape)

    weights = {}
    for name, t in load_file(str(hf / "model.safetensors")).items():
        a = t.numpy()
        if name.endswith("kv_b_proj.weight"):  # attn_v_b is quantized along kv_lora; attn_k_b, nope wide, is not
            kv_b = a.reshape(cfg["num_attention_heads"], nope + cfg["v_head_dim"], -1).copy()
            kv_b[:, nope:] = rounded(kv_b[:, nope:])
            a = kv_b.reshape(a.shape)
        elif a.ndim == 2 and a.shape[-1] % 32 == 0:
            a = rounded(a)
        weights[name] = torch.from_numpy(np.ascontiguousarray(a))
    out.mkdir()
    for f in hf.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_q8_0_gguf_served_gives_transformers_greedy_tokens(tmp_path, hf_greedy, pdserve_cache):
    hf = make_tiny_deepseek_v3(tmp_path / "hf", seed=2)
    path = write_deepseek2_gguf(hf, tmp_path / "m.q8_0.gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(_q8_0_rounded(hf, tmp_path / "oracle"),
                                                              torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 23)]
    ref = hf_greedy(model, prompts, 10)
    assert all(len(set(r)) >= 6 for r in ref), ref  # varied streams
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(EngineConfig(model=str(path), cache_dir=str(pdserve_cache), tokens_per_block=8)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == ref


def test_a_deepseek_v2_file_is_refused_by_name(tmp_path):
    """Softmax routing (expert_gating_func 1, no score bias): DeepSeek-V2's, which pdserve does not serve."""
    hf = make_tiny_deepseek_v3(tmp_path / "hf")
    v3 = gguf.GGUFReader(write_deepseek2_gguf(hf, tmp_path / "v3.gguf", quant="F32"))
    w = gguf.GGUFWriter(str(tmp_path / "v2.gguf"), "deepseek2")
    for f in v3.fields.values():
        if f.name.startswith(("GGUF.", "general.architecture")):
            continue
        v = 1 if f.name == "deepseek2.expert_gating_func" else f.contents()
        if isinstance(v, list):
            w.add_array(f.name, v)
        else:
            {str: w.add_string, bool: w.add_bool, int: w.add_uint32, float: w.add_float32}[type(v)](f.name, v)
    for t in v3.tensors:
        if ".exp_probs_b." not in t.name:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="DeepSeek-V2's routing"):
        convert_gguf(tmp_path / "v2.gguf", tmp_path / "out", progress=False)
