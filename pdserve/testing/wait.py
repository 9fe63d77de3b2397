"""Bounded waits for what another thread or process does in its own time."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(cond: Callable[[], object], timeout_s: float = 5.0, poll_s: float = 0.01) -> bool:
    """Poll `cond` until it is true or `timeout_s` passes; return its last value as a bool."""
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(poll_s)
    return bool(cond())
