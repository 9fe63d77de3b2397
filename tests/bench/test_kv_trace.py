"""bench_kv_transfer.py --trace: the wrappers it puts around the transceiver find every stage of a real
context_first transfer between two processes (shared memory), so a renamed or re-signed transceiver
method shows here, not as a trace that silently lacks a stage."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kv_transfer.py"
STAGES_AFTER_ASKED = ["sent", "received", "applied", "planned", "submitted", "notified", "reported"]


def test_the_trace_holds_every_stage_of_each_rep():
    out = subprocess.run([sys.executable, str(BENCH), "--backend", "shm", "--tokens", "16", "--dtypes", "bf16",
                          "--tables", "contiguous", "--contiguous-reps", "3", "--trace"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "trace of 3 context_first reps" in out.stdout, out.stdout
    since = {m[1]: float(m[2]) for m in re.finditer(r"^\s+(\w+)\s+-?[\d.]+\s+\(\s*([\d.]+)\)$", out.stdout, re.M)}
    assert list(since) == STAGES_AFTER_ASKED, out.stdout
    assert 0 < since["submitted"] <= since["reported"], out.stdout
