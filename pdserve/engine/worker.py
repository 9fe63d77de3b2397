"""Process entry for ranks other than 0: join the group, load the shard, follow rank 0's steps."""

from __future__ import annotations

import logging
import os

import torch


def pick_device(choice: str, rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device: cuda was requested but no CUDA device is visible")
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def set_threads(ecfg) -> None:
    n = ecfg.num_threads or max(1, (os.cpu_count() or 1) // ecfg.world_size)
    torch.set_num_threads(n)


def worker_main(rank: int, ecfg, model_dir: str, port: int, max_model_len: int, instance_name: str) -> None:
    from pathlib import Path

    from pdserve.distributed import init_parallel
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.models.config import ModelConfig
    from pdserve.weights.hf_dir import read_config

    logging.basicConfig(level=logging.WARNING)
    set_threads(ecfg)
    device = pick_device(ecfg.device, rank)
    ps = init_parallel(ecfg.tensor_parallel_size, ecfg.pipeline_parallel_size, rank, ecfg.dist_host, port,
                       "nccl" if device.type == "cuda" else "gloo", ecfg.dist_timeout_s)
    model_cfg = ModelConfig.from_hf(read_config(Path(model_dir)))
    runner = ModelRunner(ecfg, model_cfg, Path(model_dir), ps, device, max_model_len, instance_name)
    runner.serve_forever()
