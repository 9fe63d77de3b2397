"""The tiny checkpoints pdserve/testing still writes by hand (Llama, Qwen2, Mistral, Qwen3.5's text model,
DeepSeek-V3) hold exactly the tensors, names and shapes, that transformers' save_pretrained of their class
writes for the same config, and their config.json reads as the config save_pretrained writes: a test model can
never carry a spelling no published checkpoint has (as the old Nemotron-H writer's model.* did)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from pdserve.models.config import ModelConfig
from pdserve.testing import make_tiny_model
from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3
from pdserve.weights.hf_dir import read_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _tensors(d) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in sorted(d.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            shapes |= {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    return shapes


@pytest.mark.parametrize("arch, tied", [("llama", False), ("llama", True), ("qwen2", True), ("mistral", False),
                                        ("qwen3_5", False), ("deepseek_v3", False)])
def test_hand_written_tiny_checkpoint_is_what_save_pretrained_writes(tmp_path, arch, tied):
    ours = (make_tiny_deepseek_v3(tmp_path / "ours", num_layers=2) if arch == "deepseek_v3" else
            make_tiny_model(tmp_path / "ours", arch=arch, num_layers=4 if arch == "qwen3_5" else 2,
                            tie_word_embeddings=tied))
    config = transformers.AutoConfig.from_pretrained(ours)
    model_class = getattr(transformers, config.architectures[0])
    with torch.device("meta"):  # names and shapes only
        model = model_class(config)
    theirs = tmp_path / "theirs"
    model = model.to_empty(device="cpu")
    model.tie_weights()  # (to_empty gives the tied head storage of its own)
    model.save_pretrained(theirs)
    assert _tensors(ours) == _tensors(theirs)
    assert ModelConfig.from_hf(read_config(ours)) == ModelConfig.from_hf(read_config(theirs))
