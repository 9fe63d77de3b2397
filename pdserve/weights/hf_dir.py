"""A Hugging Face model directory: the one format the engine loads weights from.

Layout read and written here:

    config.json                         model hyper-parameters (architectures, hidden_size, ...)
    model.safetensors                   all tensors, or, when sharded:
    model-00001-of-0000N.safetensors    ... plus model.safetensors.index.json {"weight_map": name -> file}
    tokenizer.json                      a `tokenizers` Tokenizer
    tokenizer_config.json               chat_template, bos/eos/pad/unk tokens
    generation_config.json              optional: eos_token_id (int or list)

Tensors are opened lazily through `safe_open` (memory-mapped), so a tensor-parallel rank reads only
its own slice of each weight: `open_tensors(d)["model.layers.0.mlp.up_proj.weight"].narrow(0, a, n)`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# Hugging Face's own default shard size is a few GB; 2 GiB keeps each file mmap-friendly.
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file; a syntax error names the file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-create or re-download it") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def check_hf_dir(model_dir: str | os.PathLike) -> Path:
    """Return `model_dir` as a Path if it holds config.json and safetensors weights.

    Raises ValueError naming each missing piece and how to produce it.
    """
    d = Path(model_dir)
    if not d.is_dir():
        raise ValueError(f"model directory {d} does not exist or is not a directory")
    missing = []
    if not (d / CONFIG_FILE).is_file():
        missing.append(CONFIG_FILE)
    if not (d / INDEX_FILE).is_file() and not any(d.glob("*.safetensors")):
        bins = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
        hint = f" (found {bins}: pdserve reads safetensors only; re-save with " \
               "model.save_pretrained(dir, safe_serialization=True))" if bins else ""
        missing.append(f"*.safetensors weights{hint}")
    if missing:
        raise ValueError(
            f"{d} is not a Hugging Face model directory: missing {', '.join(missing)}. "
            "Pass a directory written by save_pretrained / `pdserve convert`, or a .gguf file."
        )
    return d


def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The parsed config.json of an HF model directory."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{path} not found: {model_dir} is not a Hugging Face model directory")
    return read_json(path)


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of an HF model directory: the shards model.safetensors.index.json names (each
    checked to exist), else every *.safetensors file."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} names shards that do not exist: {absent}; download them again")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    return files


@dataclass(frozen=True)
class LazyTensor:
    """One tensor of a safetensors file, read from disk only when asked.

    `shape` and `dtype` come from the file header, so planning (shard sizes, memory budgets) costs
    no I/O. `load` reads everything; `narrow` and `get_slice` read only the requested region.
    """

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    _handle: Any  # safetensors safe_open handle shared by every tensor of `file`

    def load(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)

    def get_slice(self) -> Any:
        """safetensors' slice object: index it like a tensor (`s[:, a:b]`) to read that region."""
        return self._handle.get_slice(self.name)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read `tensor.narrow(dim, start, length)` without reading the rest of the tensor."""
        if not 0 <= dim < len(self.shape):
            raise ValueError(f"{self.name}: dim {dim} out of range for shape {self.shape}")
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"{self.name}: slice [{start}, {start + length}) of dim {dim} exceeds size {self.shape[dim]}"
            )
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self.get_slice()[index]


class TensorStore(Mapping[str, LazyTensor]):
    """All tensors of an HF model directory by name, across shards, loaded lazily."""

    def __init__(self, model_dir: str | os.PathLike):
        self.model_dir = Path(model_dir)
        self._handles: dict[Path, Any] = {}
        self._tensors: dict[str, LazyTensor] = {}
        for file in weight_files(self.model_dir):
            handle = safe_open(str(file), framework="pt")
            self._handles[file] = handle
            for name in handle.keys():
                if name in self._tensors:
                    raise ValueError(
                        f"tensor {name} appears in both {self._tensors[name].file.name} and {file.name}; "
                        "remove the stale shard from the model directory"
                    )
                sl = handle.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise ValueError(f"{file.name}: tensor {name} has unsupported dtype {sl.get_dtype()}")
                self._tensors[name] = LazyTensor(name, file, tuple(sl.get_shape()), dtype, handle)

    def __getitem__(self, name: str) -> LazyTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} not found in {self.model_dir}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def close(self) -> None:
        """Drop the file handles (and their mmaps); tensors already loaded stay valid."""
        self._handles.clear()
        self._tensors.clear()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_tensors(model_dir: str | os.PathLike) -> TensorStore:
    """Mapping name -> LazyTensor over every safetensors shard of `model_dir`."""
    return TensorStore(model_dir)


class ShardedWriter:
    """Streams tensors into safetensors shards of at most `max_shard_bytes` each.

    Only one shard is held in memory at a time, so a model larger than RAM converts. With one shard
    the file is `model.safetensors`; with more, HF's `model-0000i-of-0000N.safetensors` names plus
    the index file. N is unknown until the end, so shards are renamed in `close`.
    """

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        t = tensor.detach().contiguous()
        if t.untyped_storage().nbytes() != nbytes:
            # safetensors refuses views that share storage; give this tensor its own buffer.
            t = t.clone()
        self._pending[name] = t
        self._pending_bytes += nbytes
        self._total_bytes += nbytes

    def _flush(self) -> None:
        path = self.out_dir / f"shard-{len(self._shards):05d}.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write what is pending, give shards their final names; returns the shard paths."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            final = [self.out_dir / "model.safetensors"]
        else:
            final = [self.out_dir / f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (tmp, names), dst in zip(self._shards, final):
            tmp.rename(dst)
            weight_map.update({name: dst.name for name in names})
        if n > 1:
            write_json(
                self.out_dir / INDEX_FILE,
                {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map},
            )
        return final
