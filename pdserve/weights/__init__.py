"""Checkpoints: the Hugging Face model directory the engine loads, and how to get one.

    resolve_model(spec, cache_dir)  -> HF dir (default model, a .gguf converted once, or an HF dir)
    convert_gguf(gguf, out_dir)     -> HF dir written from a GGUF file
    read_config(dir), open_tensors(dir)[name].narrow(dim, start, n)   lazy, shard-aware reads
"""

from pdserve.weights.gguf_convert import convert_gguf
from pdserve.weights.hf_dir import (
    LazyTensor,
    ShardedWriter,
    TensorStore,
    check_hf_dir,
    open_tensors,
    read_config,
)
from pdserve.weights.resolve import (
    DEFAULT_MODEL_INSTALL,
    ModelNotFoundError,
    default_cache_dir,
    default_model_gguf,
    resolve_model,
)

__all__ = [
    "DEFAULT_MODEL_INSTALL",
    "LazyTensor",
    "ModelNotFoundError",
    "ShardedWriter",
    "TensorStore",
    "check_hf_dir",
    "convert_gguf",
    "default_cache_dir",
    "default_model_gguf",
    "open_tensors",
    "read_config",
    "resolve_model",
]
