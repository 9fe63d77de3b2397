"""Shared KV memory is allocated when it is asked for, not when a request first writes it.

Two defects of lazily backed /dev/shm files:
- a /dev/shm smaller than the pool (Docker's default is 64 MiB) accepted the pool and killed the process
  with SIGBUS at the first write past its end;
- every block's first write (a prefill into it, a peer's transfer into it) paid the page faults on the
  request's critical path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from pdserve.kv_transfer.agents.shm import allocate_shared


def _rss_kib(ptr: int) -> int:
    """Resident KiB of this process's mapping that starts at `ptr`."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == ptr
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping starts at {ptr:#x}")


def test_the_pages_are_allocated_and_mapped_up_front():
    nbytes = 8 << 20
    buf = allocate_shared(nbytes)
    try:
        blocks = os.stat(buf.path).st_blocks * 512
        assert blocks >= nbytes, f"only {blocks} of {nbytes} bytes of the file are allocated"
        assert _rss_kib(buf.ptr) * 1024 >= nbytes, "the mapping's pages were not faulted in"
    finally:
        buf.free()


PROBE = textwrap.dedent("""
    import sys
    from pdserve.kv_transfer.agents import shm
    shm._SHM_DIR = sys.argv[1]
    try:
        buf = shm.allocate_shared(32 << 20)
    except MemoryError as e:
        print("REFUSED", e)
        raise SystemExit(0)
    buf.numpy()[:] = 1  # what the engine would do, a write at a time, as requests come
    print("WROTE")
""")


def test_a_dev_shm_smaller_than_the_pool_is_a_clear_error():
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare")
    # An 8 MiB tmpfs in a private mount namespace stands in for a container's small /dev/shm.
    script = ('d=$(mktemp -d) && mount -t tmpfs -o size=8m pdserve-test "$d" && '
              f'exec {sys.executable} -c "$PROBE" "$d"')
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                           env={**os.environ, "PROBE": PROBE}, capture_output=True, text=True, timeout=120)
    if "mount" in probe.stderr and probe.returncode not in (0, -7, 135):
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()[-300:]}")
    assert probe.returncode == 0, f"the process died (status {probe.returncode}): {probe.stderr[-2000:]}"
    assert "REFUSED" in probe.stdout, probe.stdout
    message = probe.stdout.split("REFUSED", 1)[1]
    assert "0.03 GiB" in message and "kv_cache_memory_gb" in message and "--shm-size" in message, message
