"""HF directory helpers: lazy tensor access across shards, sharded writing, clear validation errors."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.testing import make_tiny_model
from pdserve.weights.hf_dir import ShardedWriter, check_hf_dir, open_tensors, read_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", arch="qwen2")


def test_open_tensors_matches_file(tiny):
    full = load_file(str(tiny / "model.safetensors"))
    with open_tensors(tiny) as store:
        assert set(store) == set(full)
        for name, t in full.items():
            lazy = store[name]
            assert lazy.shape == tuple(t.shape) and lazy.dtype == t.dtype
            assert torch.equal(lazy.load(), t)


def test_narrow_reads_the_same_slice(tiny):
    store = open_tensors(tiny)
    w = store["model.layers.1.self_attn.q_proj.weight"]
    full = w.load()
    for dim in (0, 1):
        size = full.shape[dim]
        assert torch.equal(w.narrow(dim, size // 4, size // 2), full.narrow(dim, size // 4, size // 2))
    assert torch.equal(w.get_slice()[2:5], full[2:5])
    with pytest.raises(ValueError, match="exceeds size"):
        w.narrow(0, full.shape[0] - 1, 2)
    with pytest.raises(KeyError, match="not found"):
        store["model.layers.9.mlp.up_proj.weight"]


def test_sharded_writer_round_trips_through_transformers(tiny, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "sharded"
    out.mkdir()
    original = load_file(str(tiny / "model.safetensors"))
    writer = ShardedWriter(out, max_shard_bytes=20_000)
    for name, t in original.items():
        writer.add(name, t)
    shards = writer.close()
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not list(out.glob("*.tmp"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / f, out / f)
    store = open_tensors(out)
    assert {n: store[n].load() for n in store}.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(store[name].load(), t)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(model.state_dict()["model.norm.weight"], original["model.norm.weight"])


def test_writer_copies_views(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    writer = ShardedWriter(tmp_path)
    writer.add("a", base[0])
    writer.add("b", base[1:])
    writer.close()
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(loaded["a"], base[0]) and torch.equal(loaded["b"], base[1:])


def test_validation_names_what_is_missing(tiny, tmp_path):
    assert check_hf_dir(tiny) == tiny
    assert read_config(tiny)["model_type"] == "qwen2"
    with pytest.raises(ValueError, match="does not exist"):
        check_hf_dir(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"missing config.json, \*.safetensors"):
        check_hf_dir(empty)
    (empty / "config.json").write_text("{}")
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="safetensors only"):
        check_hf_dir(empty)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_config(empty)


def test_duplicate_tensor_across_shards_is_refused(tmp_path):
    save_file({"x": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"x": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match="appears in both"):
        open_tensors(tmp_path)
