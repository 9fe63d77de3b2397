"""Bounded waits for what another thread or process does in its own time."""

from __future__ import annotations

import contextlib
import os
import signal
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


def wait_for_line(proc, needle: str, timeout: float) -> str:
    """Read `proc`'s text stdout until a line holds `needle`; everything read so far. AssertionError with
    that output when the process ends or `timeout` passes first (a line still being written blocks the read:
    keep `timeout` for processes that print)."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"no {needle!r} from {' '.join(map(str, proc.args[-3:]))}:\n{''.join(seen)}")


@contextlib.contextmanager
def reaped(proc):
    """Yields `proc` (started with start_new_session=True); one still running on the way out, the test
    having failed, is killed with its whole process group."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stop_cleanly(proc, timeout: float = 60.0) -> str:
    """SIGTERM `proc`, wait for it, and check it exited 0; its remaining text output."""
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out
