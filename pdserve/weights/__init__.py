"""Checkpoints: the Hugging Face model directory the engine loads, and how to get one.

    resolve_model(spec, cache_dir)  -> HF dir (default model, a .gguf converted once, or an HF dir)
    convert_gguf(gguf, out_dir)     -> HF dir written from a GGUF file
    read_config(dir), open_tensors(dir)[name].narrow(dim, start, n)   lazy, shard-aware reads
"""

from pdserve.weights.hf_dir import (
    LazyTensor,
    ShardedWriter,
    TensorStore,
    check_hf_dir,
    open_tensors,
    read_config,
)

__all__ = [
    "LazyTensor",
    "ShardedWriter",
    "TensorStore",
    "check_hf_dir",
    "open_tensors",
    "read_config",
]
