"""Process entry for ranks other than 0: join the group, load the shard, follow rank 0's steps."""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


def pick_device(choice: str, rank: int, world_size: int) -> torch.device:
    """The device of `rank` among `world_size` ranks. NCCL runs one rank per CUDA device, so CUDA
    needs a device for every rank: `auto` falls back to the CPU (and says so) when there are fewer,
    `cuda` refuses with what to change."""
    if choice == "cpu":
        return torch.device("cpu")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda" and visible == 0:
        raise ValueError("device: cuda was requested but no CUDA device is visible; set device: cpu")
    if visible and visible < world_size:
        why = (f"tensor_parallel_size x pipeline_parallel_size = {world_size} ranks, and NCCL needs a CUDA "
               f"device for each, but {visible} {'is' if visible == 1 else 'are'} visible")
        if choice == "cuda":
            raise ValueError(f"device: cuda with {why}; use at most {visible} ranks or set device: cpu")
        if rank == 0:
            log.warning("device: auto runs on the CPU: %s", why)
        return torch.device("cpu")
    return torch.device("cuda", rank) if visible else torch.device("cpu")


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
    device = pick_device(ecfg.device, rank, ecfg.world_size)
    ps = init_parallel(ecfg.tensor_parallel_size, ecfg.pipeline_parallel_size, rank, ecfg.dist_host, port, device,
                       ecfg.dist_timeout_s)
    model_cfg = ModelConfig.from_hf(read_config(Path(model_dir)))
    runner = ModelRunner(ecfg, model_cfg, Path(model_dir), ps, device, max_model_len, instance_name)
    runner.serve_forever()
