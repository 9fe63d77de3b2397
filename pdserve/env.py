"""The environment variables pdserve reads, each in one place, with one meaning: the ground floor of the
config layer.

Everything else of a process's configuration is a checked config (EngineConfig, WorkerConfig,
DisaggConfig) passed whole; what stays in the environment is what a process needs before it has a config,
or what a parent hands its children through it:

    PDSERVE_CACHE_DIR        the base of pdserve's caches (~/.cache/pdserve): converted/ (GGUF models
                             converted once), profiles/ (`pdserve plan`), kernels/ (the compiled kernels),
                             configs/ (models' config.json as pdserve read them)
    PDSERVE_KERNEL_CACHE     the compiled kernel library and its dispatch choices (<base>/kernels)
    PDSERVE_CPU_KERNELS      1 (default) or 0: 0 keeps every layer in PyTorch (no native kernel is built)
    PDSERVE_KERNEL_MARCH     the -march the kernels are compiled for (native)
    PDSERVE_KERNEL_PATH      the kernel dispatch's forced paths (auto: timed; see kernels/dispatch.py)
    PDSERVE_SHM_ALL_REDUCE   1 (default) or 0: 0 keeps the tensor-parallel all-reduce on gloo
    PDSERVE_HOST_ID          this host's id for "can these two share memory?" (hostname/boot id)
    PDSERVE_DISAGG_CONFIG    the orchestrator fleet's validated config (JSON), from its supervisor
    CC                       the C compiler that builds the kernels (cc)

`settings()` reads them when pdserve reaches a decision that needs one (building the kernel library,
resolving a model, naming the host), never at import, so a value set before that point (by a parent, a
test) is the one taken. A value outside a variable's range is a ValueError naming the variable.

Variables pdserve only sets are writes, and stay with the code that sets them: THP_MEM_ALLOC_ENABLE
(pdserve/__init__.py, for PyTorch's allocator) and the variables of a child's environment (`for_child`).
tests/test_env_reads.py holds every other module to that: none reads os.environ.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = "PDSERVE_CACHE_DIR"
KERNEL_CACHE = "PDSERVE_KERNEL_CACHE"
CPU_KERNELS = "PDSERVE_CPU_KERNELS"
KERNEL_MARCH = "PDSERVE_KERNEL_MARCH"
KERNEL_PATH = "PDSERVE_KERNEL_PATH"
SHM_ALL_REDUCE = "PDSERVE_SHM_ALL_REDUCE"
HOST_ID = "PDSERVE_HOST_ID"
DISAGG_CONFIG = "PDSERVE_DISAGG_CONFIG"
COMPILER = "CC"


def _switch(environ: Mapping[str, str], name: str) -> bool:
    """An on/off variable: unset or empty is on (the default), 1 on, 0 off."""
    value = environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r}: expected 1 (on, the default) or 0 (off)")
    return value != "0"


def _text(environ: Mapping[str, str], name: str) -> str | None:
    """A variable's value, stripped; None when unset or empty."""
    return environ.get(name, "").strip() or None


@dataclass(frozen=True)
class Settings:
    """What the environment says, parsed: one field per variable (module docstring)."""

    cache_dir: Path
    kernel_cache: Path
    cpu_kernels: bool
    kernel_march: str
    kernel_path: str
    shm_all_reduce: bool
    host_id: str | None
    disagg_config: str | None
    compiler: str

    @property
    def converted_dir(self) -> Path:
        """Where GGUF models are converted into HF directories (EngineConfig.cache_dir's default)."""
        return self.cache_dir / "converted"

    @property
    def profiles_dir(self) -> Path:
        """Where `pdserve plan` keeps this machine's measured profiles."""
        return self.cache_dir / "profiles"

    @property
    def configs_dir(self) -> Path:
        """Where a model's config.json, read once through transformers, is remembered (models/config_memo.py)."""
        return self.cache_dir / "configs"

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> Settings:
        base = _text(environ, CACHE_DIR)
        cache_dir = Path(base).expanduser() if base else Path.home() / ".cache" / "pdserve"
        kernel_cache = _text(environ, KERNEL_CACHE)
        return cls(
            cache_dir=cache_dir,
            kernel_cache=Path(kernel_cache).expanduser() if kernel_cache else cache_dir / "kernels",
            cpu_kernels=_switch(environ, CPU_KERNELS),
            kernel_march=_text(environ, KERNEL_MARCH) or "native",
            kernel_path=_text(environ, KERNEL_PATH) or "auto",
            shm_all_reduce=_switch(environ, SHM_ALL_REDUCE),
            host_id=_text(environ, HOST_ID),
            disagg_config=_text(environ, DISAGG_CONFIG),
            compiler=_text(environ, COMPILER) or "cc",
        )


def settings() -> Settings:
    """This process's settings, from its environment as it is now."""
    return Settings.read(os.environ)


def for_child(overrides: Mapping[str, str]) -> dict[str, str]:
    """A child process's environment: this process's, with `overrides` set (a write, not a read: the
    child reads what it needs through its own settings())."""
    return {**os.environ, **overrides}
