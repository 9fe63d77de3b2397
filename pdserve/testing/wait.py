"""Bounded waits for what another thread or process does in its own time."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(cond: Callable[[], object], timeout_s: float = 5.0, poll_s: float = 0.01) -> bool:
    """Poll `cond` until it is true or `timeout_s` passes. Returns the value that ended the wait: a
    condition that flaps (each call may ask another process) is not asked again after it held."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value or time.monotonic() >= deadline:
            return bool(value)
        time.sleep(poll_s)
