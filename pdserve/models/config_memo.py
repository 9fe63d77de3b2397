"""ModelConfig.from_hf's answers, remembered on disk, so a process that starts a server does not import
transformers only to read a config.json it (or another process) has read before.

Reading config.json through transformers' config class (config.py) is what makes aliases and defaults
transformers'; it also imports transformers, about a second of every server process's start. The answer
depends only on the config's content, transformers' version and pdserve's model code, so it is kept under
`<cache>/configs/`, named by a hash of those three. A config transformers refuses is never remembered: it
is read, and refused, every time. A remembered file that does not read back (cut short, from other code) is
read again the long way and written anew.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import types
import typing
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from pdserve.env import settings

log = logging.getLogger(__name__)
T = TypeVar("T")
_MODELS = Path(__file__).parent


def default_dir() -> Path:
    """`configs/` under pdserve's cache ($PDSERVE_CACHE_DIR, else ~/.cache/pdserve; pdserve/env.py)."""
    return settings().configs_dir


def remembered(cfg: dict[str, Any], read: Callable[[dict[str, Any]], T], cls: type[T],
               cache_dir: Path | None) -> T:
    """`read(cfg)`, or its answer for an equal `cfg` remembered under `cache_dir` (None: not remembered)."""
    if cache_dir is None:
        return read(cfg)
    path = cache_dir / f"{_key(cfg)}.json"
    try:
        return _decode(cls, json.loads(path.read_text()))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.warning("remembered model config %s does not read back (%s): reading config.json again", path, e)
    answer = read(cfg)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
        tmp.write_text(json.dumps(dataclasses.asdict(answer)))
        os.replace(tmp, path)  # whole or not at all, whoever else writes the same answer at once
    except OSError as e:  # a read-only cache costs the next start a second, nothing more
        log.debug("model config not remembered under %s: %s", cache_dir, e)
    return answer


def _key(cfg: dict[str, Any]) -> str:
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=repr).encode())
    h.update(metadata.version("transformers").encode())
    for source in sorted(_MODELS.glob("*.py")):  # any change to the model code may change the reading
        h.update(source.name.encode())
        h.update(source.read_bytes())
    return h.hexdigest()[:32]


def _decode(kind: Any, value: Any) -> Any:
    """JSON back into `kind`: dataclasses field by field, tuples from lists, an optional by its value."""
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        return kind(**{f.name: _decode(hints[f.name], value[f.name]) for f in dataclasses.fields(kind)})
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, value)
    if origin is tuple:
        return tuple(_decode(args[0], v) for v in value)
    if kind is float and isinstance(value, int):
        return float(value)
    if isinstance(kind, type) and not isinstance(value, kind):
        raise TypeError(f"{value!r} is not a {kind.__name__}")
    return value
