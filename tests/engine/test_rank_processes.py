"""The rank processes of a multi-rank `pdserve serve`, killed with -9: alone, rank 0 takes the others
with it; as a whole process group (what `pdserve launch` does to a member that will not stop, and every
test teardown), nothing is left in /dev/shm. Before, each spawned rank left one named semaphore there
(tqdm's lock, which only the killed group's resource tracker would have unlinked)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import psutil
import pytest

from pdserve.host import free_port
from pdserve.testing import make_tiny_model
from pdserve.testing.servers import wait_for_health
from pdserve.testing.wait import reaped, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.faults]


def _semaphores() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("sem.")}


def _start_tp2(model, tmp_path):
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", str(model), "--port", str(port),
                             "--tensor-parallel-size", "2", "--num-threads", "1"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", lambda: log.read_text()


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for its reaper counts: it runs nothing)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _ranks(proc) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("ranks") / "m", num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=16)


def test_a_tp2_server_killed_as_a_group_leaves_no_semaphore(model, tmp_path):
    before = _semaphores()
    proc, url, log = _start_tp2(model, tmp_path)
    with reaped(proc):
        wait_for_health(url, proc, log, timeout=120)
        group = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert _ranks(proc), "no spawned rank: the server did not start a second rank"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert wait_until(lambda: all(_gone(p) for p in group), timeout_s=10, poll_s=0.1)
    assert _semaphores() - before == set(), "named semaphores left in /dev/shm by the killed instance"


def test_rank_0_killed_alone_takes_the_other_ranks_with_it(model, tmp_path):
    proc, url, log = _start_tp2(model, tmp_path)
    with reaped(proc):
        wait_for_health(url, proc, log, timeout=120)
        ranks = _ranks(proc)
        assert ranks, "no spawned rank: the server did not start a second rank"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert wait_until(lambda: all(_gone(r.pid) for r in ranks), timeout_s=10, poll_s=0.1), \
            f"rank processes {ranks} outlived rank 0 by 10 s"


def test_a_server_whose_step_loop_dies_exits_non_zero(model, tmp_path):
    """Rank 1 killed alone: rank 0's next step cannot reach it and the step loop dies. The request gets
    a 503 naming the failure, then the server exits with status 3 (a supervisor restarts a process that
    exits; one alive answering 503 "engine is not running" it leaves alone)."""
    from pdserve.cli import EXIT_ENGINE_DIED

    proc, url, log = _start_tp2(model, tmp_path)
    with reaped(proc):
        wait_for_health(url, proc, log, timeout=120)
        ranks = _ranks(proc)
        assert ranks, "no spawned rank: the server did not start a second rank"
        for rank in ranks:
            rank.kill()
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 503, r.text
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the server still runs 60 s after its step loop died:\n{log()[-3000:]}") from None
        assert code == EXIT_ENGINE_DIED, log()[-3000:]
        assert "exiting: the engine's step loop died" in log()
