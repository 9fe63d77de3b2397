"""Host utilities shared by launch, plan, testing and benchmarks: what a process needs of the machine it
runs on, nothing about models or serving."""

from __future__ import annotations

import os
import signal
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child between fork and exec (Linux): the kernel sends it `sig` when the process that started it
    dies, by any signal, SIGKILL included; otherwise a killed launcher would leave its servers running."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read (it holds the cluster token), whatever was there before."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)
