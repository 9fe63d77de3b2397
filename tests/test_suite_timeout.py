"""No test can hang the suite: the project's pytest settings give every test a bounded time, and a test
that passes it fails with its traceback while the run goes on to the next test."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]

# A raw DEALER that never had a peer has no pipe to queue for: a plain send waits forever.
_HANGS = '''
import zmq

def test_blocks_in_a_send_with_no_peer():
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect("tcp://127.0.0.1:9")
    sock.send(b"never queued")

def test_after_the_hang():
    pass
'''


def test_the_suite_has_a_bounded_per_test_timeout():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 60 <= int(ini["timeout"]) <= 1800
    assert ini["timeout_method"] == "signal"  # "thread" ends the whole run at the first timeout


def test_a_hanging_test_fails_with_its_traceback_and_the_run_goes_on(tmp_path):
    (tmp_path / "test_hang.py").write_text(_HANGS)
    # The project's own settings, with only the limit shortened so the check takes seconds.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
           "--rootdir", str(tmp_path), "-o", "timeout=3", str(tmp_path / "test_hang.py")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "1 failed, 1 passed" in out.stdout, out.stdout + out.stderr
    assert "Timeout (>3.0s) from pytest-timeout" in out.stdout
    assert 'sock.send(b"never queued")' in out.stdout  # the traceback points at the hanging line
