"""Hostile ZeroMQ peers for the frame-bound tests: a child process sends the oversized frame, so the
only memory it can cost this process is what our own socket buffers; `PeakRss` samples this
process's RSS every millisecond while the frame travels (without a bound it peaks at about twice
the frame, libzmq's buffer and the Python copy, even though both are freed right after)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import psutil

FRAME = 64 << 20
MAX_GROWTH = 16 << 20  # well under the frame: a buffered frame shows as >= FRAME


class PeakRss:
    """Peak growth of this process's RSS over its value on entry, sampled every millisecond."""

    def __enter__(self) -> PeakRss:
        self._proc = psutil.Process()
        self._base = self._peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def growth(self) -> int:
        return self._peak - self._base


def run_peer(code: str, timeout_s: float = 30) -> None:
    """Run a hostile peer to its end (it sleeps after sending, so the frame is on the wire)."""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=timeout_s)


def start_peer(code: str) -> tuple[subprocess.Popen, str]:
    """Start a hostile server; it prints the endpoint it bound first."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def stop_peer(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)
