"""Process entry for ranks other than 0: join the group, load the shard, follow rank 0's steps."""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


def pick_device(ecfg, rank: int) -> torch.device:
    """The device of `rank`. CUDA needs a device for every rank (NCCL runs one rank per device) and a
    transceiver that moves device memory (the shm agent moves host memory only). `auto` takes CUDA
    when both hold and the CPU otherwise, saying why when a CUDA device was there; `cuda` refuses
    with what to change."""
    if ecfg.device == "cpu":
        return torch.device("cpu")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        if ecfg.device == "cuda":
            raise ValueError("device: cuda was requested but no CUDA device is visible; set device: cpu")
        return torch.device("cpu")
    why = None
    if visible < ecfg.world_size:
        why = (f"tensor_parallel_size x pipeline_parallel_size = {ecfg.world_size} ranks, and NCCL needs a CUDA "
               f"device for each, but {visible} {'is' if visible == 1 else 'are'} visible")
        fix = f"use at most {visible} ranks or set device: cpu"
    elif ecfg.cache_transceiver_config.backend == "shm":
        why = "cache_transceiver_config.backend is shm, which moves host memory only"
        fix = "use backend: nixl or set device: cpu"
    if why is None:
        return torch.device("cuda", rank)
    if ecfg.device == "cuda":
        raise ValueError(f"device: cuda, but {why}; {fix}")
    if rank == 0:
        log.warning("device: auto runs on the CPU: %s", why)
    return torch.device("cpu")


def set_threads(ecfg) -> None:
    n = ecfg.num_threads or max(1, (os.cpu_count() or 1) // ecfg.world_size)
    torch.set_num_threads(n)


def worker_main(rank: int, ecfg, model_dir: str, model_cfg, port: int, max_model_len: int, instance_name: str) -> None:
    from pathlib import Path

    from pdserve.host import no_named_semaphores

    from pdserve.engine.model_runner import ModelRunner
    from pdserve.parallel.shm_all_reduce import attach_shm_all_reduce
    from pdserve.parallel.state import init_parallel

    no_named_semaphores()
    logging.basicConfig(level=logging.WARNING)
    set_threads(ecfg)
    device = pick_device(ecfg, rank)
    ps = init_parallel(ecfg.tensor_parallel_size, ecfg.pipeline_parallel_size, rank, ecfg.dist_host, port, device,
                       ecfg.dist_timeout_s)
    attach_shm_all_reduce(ps, device, ecfg.dist_timeout_s)
    runner = ModelRunner(ecfg, model_cfg, Path(model_dir), ps, device, max_model_len, instance_name)
    runner.serve_forever()
