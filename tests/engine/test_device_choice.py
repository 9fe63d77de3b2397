"""Which device each rank runs on. The CUDA runtime's answers are faked: what is under test is the
choice made from them (NCCL takes one rank per device; the shm agent moves host memory only), not
CUDA itself."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.worker import pick_device


@pytest.fixture
def gpus(monkeypatch):
    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return visible


def _cfg(device: str, ranks: int = 1, backend: str | None = None) -> EngineConfig:
    return EngineConfig(device=device, tensor_parallel_size=ranks, cache_transceiver_config={"backend": backend})


def test_cpu_is_taken_as_asked(gpus):
    gpus(4)
    assert pick_device(_cfg("cpu"), 0) == torch.device("cpu")


@pytest.mark.parametrize("choice", ["auto", "cuda"])
@pytest.mark.parametrize("backend", [None, "nixl"])
def test_each_rank_gets_its_own_device(gpus, choice, backend):
    gpus(4)
    assert [pick_device(_cfg(choice, 4, backend), r) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    assert pick_device(_cfg(choice, 2, backend), 1) == torch.device("cuda", 1)


def test_auto_without_cuda_is_the_cpu(gpus):
    gpus(0)
    assert pick_device(_cfg("auto", 4), 0) == torch.device("cpu")


@pytest.mark.parametrize("cfg, says", [(_cfg("auto", 2), ["2 ranks", "1 is visible"]),
                                       (_cfg("auto", 1, "shm"), ["backend is shm, which moves host memory only"])])
def test_auto_runs_on_the_cpu_where_cuda_cannot_serve_and_says_why(gpus, caplog, cfg, says):
    gpus(1)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.worker"):
        assert pick_device(cfg, 0) == torch.device("cpu")
        assert pick_device(cfg, 1) == torch.device("cpu")
    assert len(caplog.records) == 1  # rank 0 says it, once
    assert all(s in caplog.text for s in says)


@pytest.mark.parametrize("cfg, fix", [
    (_cfg("cuda", 4), r"4 ranks.*2 are visible; use at most 2 ranks or set device: cpu"),
    (_cfg("cuda", 1, "shm"), r"shm, which moves host memory only; use backend: nixl or set device: cpu")])
def test_cuda_where_it_cannot_serve_says_what_to_change(gpus, cfg, fix):
    gpus(2)
    with pytest.raises(ValueError, match=fix):
        pick_device(cfg, 0)


def test_cuda_without_a_device_says_what_to_change(gpus):
    gpus(0)
    with pytest.raises(ValueError, match="no CUDA device is visible; set device: cpu"):
        pick_device(_cfg("cuda"), 0)
