"""Which device each rank runs on. The CUDA runtime's answers are faked: what is under test is the
choice made from them (NCCL takes one rank per device), not CUDA itself."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.engine.worker import pick_device


@pytest.fixture
def gpus(monkeypatch):
    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return visible


def test_cpu_is_taken_as_asked(gpus):
    gpus(4)
    assert pick_device("cpu", 0, 1) == torch.device("cpu")


@pytest.mark.parametrize("choice", ["auto", "cuda"])
def test_each_rank_gets_its_own_device(gpus, choice):
    gpus(4)
    assert [pick_device(choice, r, 4) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    assert pick_device(choice, 1, 2) == torch.device("cuda", 1)


def test_auto_without_cuda_is_the_cpu(gpus):
    gpus(0)
    assert pick_device("auto", 0, 4) == torch.device("cpu")


def test_auto_with_too_few_devices_runs_on_the_cpu_and_says_why(gpus, caplog):
    gpus(1)
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.worker"):
        assert pick_device("auto", 0, 2) == torch.device("cpu")
        assert pick_device("auto", 1, 2) == torch.device("cpu")
    assert len(caplog.records) == 1  # rank 0 says it, once
    assert "2 ranks" in caplog.text and "1 is visible" in caplog.text


def test_cuda_with_too_few_devices_says_what_to_change(gpus):
    gpus(2)
    with pytest.raises(ValueError, match=r"4 ranks.*2 are visible; use at most 2 ranks or set device: cpu"):
        pick_device("cuda", 0, 4)


def test_cuda_without_a_device_says_what_to_change(gpus):
    gpus(0)
    with pytest.raises(ValueError, match="no CUDA device is visible; set device: cpu"):
        pick_device("cuda", 0, 1)
