"""Shared by the launch tests."""

from __future__ import annotations

import subprocess
import time


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> str:
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
