"""A profiling child dies with the planner that started it.

Regression: `pdserve plan` killed with SIGTERM while it profiled left its spawned child running (a daemon
child is only stopped at the parent's normal exit): 113 s at 100% of a core and 4.3 GiB, measured, which
disturbed the sweep started next. The parent here is a real process running the profile's own
`_in_child` on a function that would take two minutes; it is killed with -9.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

PARENT = "import time\nfrom pdserve.plan.profile import _in_child\n_in_child(time.sleep, 120)\n"


def _spawned_child(parent: psutil.Process, timeout_s: float) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for kid in parent.children():
            try:
                if "spawn_main" in " ".join(kid.cmdline()):
                    return kid
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.1)
    raise AssertionError(f"no profiling child appeared in {timeout_s:g} s")


def test_a_killed_planner_leaves_no_profiling_child_running():
    proc = subprocess.Popen([sys.executable, "-c", PARENT])
    child = None
    try:
        child = _spawned_child(psutil.Process(proc.pid), 60)
        time.sleep(3)  # well into time.sleep(120), past the child's start-up
        proc.kill()
        proc.wait(timeout=10)
        gone, alive = psutil.wait_procs([child], timeout=10)
        assert not alive, f"the profiling child {child.pid} outlived its killed parent"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if child is not None and child.is_running():
            child.kill()
