"""The tensor-parallel all-reduce through shared memory (pdserve/parallel/shm_all_reduce.py), between real rank
processes joined as the engine joins them: every rank gets the same bits, the sum in rank order; what
does not fit a slot goes to gloo; a rank that died or hangs is an error naming it, not a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from pdserve.host import free_port

from pdserve.kernels import cpu
from pdserve.parallel.shm_all_reduce import SLOT_BYTES, AllReduceError, attach_shm_all_reduce
from pdserve.parallel.state import init_parallel

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no native kernel library here")


def _part(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def _rank(rank: int, world: int, port: int, scenario: str, out) -> None:
    torch.set_num_threads(1)
    try:
        ps = init_parallel(world, 1, rank, "127.0.0.1", port, torch.device("cpu"), 2.0)
        attach_shm_all_reduce(ps, torch.device("cpu"), 2.0)
        if scenario == "sums":
            sums = {}
            for name, shape, dtype in (("fp32", (8, 576), torch.float32), ("bf16", (3, 100), torch.bfloat16),
                                       ("big", (SLOT_BYTES // 4 + 1,), torch.float32)):
                x = _part(rank, shape, dtype)
                for _ in range(3):  # both banks, and back to the first
                    y = ps.tp_all_reduce(x.clone())
                # bytes, not a tensor: a tensor crosses the queue as shared memory the exiting rank takes along
                sums[name] = (y.view(-1).view(torch.uint8).numpy().tobytes(), shape, dtype)
            out.put((rank, ps.tp_shm is not None, sums))
        elif scenario == "disabled":
            out.put((rank, ps.tp_shm is None, None))
        elif scenario in ("dead", "silent"):
            x = _part(rank, (4, 64), torch.float32)
            ps.tp_all_reduce(x.clone())
            if rank == 1:
                if scenario == "dead":
                    os._exit(3)
                time.sleep(30)  # alive, never calls again
                return
            start = time.monotonic()
            try:
                ps.tp_all_reduce(x.clone())
                out.put((rank, "no error", 0.0))
            except AllReduceError as exc:
                out.put((rank, str(exc), time.monotonic() - start))
            out.close()
            out.join_thread()  # the result is sent before the process ends
            os._exit(0)  # not through gloo's teardown: rank 1 is gone or asleep
    except BaseException as exc:  # the test reads it instead of waiting for a rank that died
        out.put((rank, f"{type(exc).__name__}: {exc}", None))
        raise


def _tensor(raw: tuple[bytes, tuple[int, ...], torch.dtype]) -> torch.Tensor:
    data, shape, dtype = raw
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)


def _run(world: int, scenario: str, expect: int | None = None) -> list:
    """Starts `world` ranks; returns the first `expect` (default: all) results, by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, scenario, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted((out.get(timeout=60) for _ in range(world if expect is None else expect)), key=lambda r: r[0])
    finally:
        for p in procs:
            p.join(timeout=5 if expect is None else 0.5)  # a silent rank is not waited for
            if p.is_alive():
                p.kill()


def test_every_rank_gets_the_same_bits_the_sum_in_rank_order():
    results = _run(3, "sums")
    assert all(used for _, used, _ in results), "the shared-memory path was not taken"
    for name, shape, dtype in (("fp32", (8, 576), torch.float32), ("bf16", (3, 100), torch.bfloat16)):
        parts = [_part(r, shape, dtype).float() for r in range(3)]
        expected = ((parts[0] + parts[1]) + parts[2]).to(dtype)
        for rank, _, sums in results:
            assert torch.equal(_tensor(sums[name]), expected), (name, rank)
    # larger than a slot: gloo's sum, the same on every rank
    parts = [_part(r, (SLOT_BYTES // 4 + 1,), torch.float32) for r in range(3)]
    for _, _, sums in results:
        torch.testing.assert_close(_tensor(sums["big"]), parts[0] + parts[1] + parts[2])


def test_turned_off_every_rank_stays_on_gloo(monkeypatch):
    monkeypatch.setenv("PDSERVE_SHM_ALL_REDUCE", "0")  # the spawned ranks inherit it
    assert all(off for _, off, _ in _run(2, "disabled"))


def test_a_rank_that_died_is_an_error_naming_it_at_once():
    # rank 1 exits and stays a zombie of this process while rank 0 waits: that counts as gone
    ((rank, message, waited),) = _run(2, "dead", expect=1)
    assert rank == 0 and "rank 1" in message and "exited" in message, message
    assert waited < 1.5, f"noticed after {waited:.1f} s, the group's timeout is 2 s"


def test_a_rank_alive_but_silent_is_an_error_after_the_timeout():
    ((rank, message, waited),) = _run(2, "silent", expect=1)
    assert rank == 0 and "does not answer" in message, message
    assert 1.9 < waited < 10, waited
