"""This machine's costs, measured once and cached: what `pdserve plan` models every deployment from.

For each thread count (CPU; one entry per GPU count on CUDA), in a fresh process pinned to that many
cores, the real engine's forward step (ModelRunner.step, the very call serving makes) is timed on:

- prefill: one sequence of n tokens from position 0, for n in PREFILL_TOKENS (up to the context window);
- a prefill chunk at an offset (the attention cost a chunk pays for the tokens before it);
- decode: batches of B sequences, one token each, at two context lengths (a decode step reads every
  sequence's KV, so it grows with the context).

The KV cache holds whatever the pool holds: attention costs the same for any values. Then, for each
transfer backend installed that can move the device's memory (on CPU: shm, and nixl when nixl_cu12 /
nixl_cu13 imports; on CUDA: nixl, VRAM to VRAM, as the instances' pools are), one write of N bytes from
one agent's registered memory into another's, one block per fragment, timed until the initiator sees
it done.

The profile is a JSON file under ~/.cache/pdserve/profiles/, keyed by the model's files, the dtype,
the device, this CPU and core count, the pdserve and torch versions and MEASURES (raised when a change
to pdserve makes the cached figures wrong): a change of any of them measures again (`pdserve plan
--reprofile` does it on demand).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import platform
import queue
import signal
import statistics
import time
from datetime import UTC
from pathlib import Path
from typing import Any

from pdserve.env import settings
from pdserve.host import no_named_semaphores
from pdserve.host import die_with_parent
from pdserve.kv_transfer.agents.base import MemoryRegion
from pdserve.plan.measurements import Profile, StepTimings

PREFILL_TOKENS = (16, 64, 128, 256, 512, 1024, 2048, 4096)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DECODE_CONTEXTS = (128, 1024)
# 2: the serving probe after two fixes that cut what serving adds to a step (the engine built on its own
# thread; the shm pool faulted in at start-up). 3: the probe measures the cost of each decode row too.
# 4: the engine decodes several rows in one native step (cheaper decode batches), and the probe measures
# each larger instance size behind the orchestrator. 5: on CUDA the KV writes are timed VRAM to VRAM (nixl), not
# in host memory. 6: the probe reads the engine's own prefill step times (step_factor).
MEASURES = 6
CHUNK = (512, 1536)  # (chunk tokens, offset): one prefill chunk after 1536 cached tokens
TRANSFER_MB = (1, 4, 16, 64)
KV_POOL_CAP_BYTES = 3 << 30  # decode points whose KV would not fit are left out
_CHILD_TIMEOUT_S = 900.0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def thread_counts(cores: int) -> list[int]:
    """1, 2, 4, ... and the core count itself: the instance sizes a plan considers on this machine."""
    out, n = [], 1
    while n < cores:
        out.append(n)
        n *= 2
    return out + [cores]


def profile_key(model_dir: Path, dtype: str, device: str, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    import torch

    import pdserve

    files = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in model_dir.iterdir() if p.is_file())
    digest = hashlib.sha256(json.dumps([str(model_dir.resolve()), files]).encode()).hexdigest()[:16]
    if device == "cuda":
        machine = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda"
        units = torch.cuda.device_count() if torch.cuda.is_available() else 0
    else:
        machine, units = cpu_model(), len(usable_cores())
    key = {"model": str(model_dir), "model_digest": digest, "dtype": dtype, "device": device, "machine": machine,
           "units": units, "pdserve": pdserve.__version__, "torch": torch.__version__, "measures": MEASURES}
    if kv_cache_dtype != "auto":  # only then: the profiles measured before the key had it stay valid
        key["kv_cache_dtype"] = kv_cache_dtype
    return key


def profiles_dir() -> Path:
    return settings().profiles_dir


def cache_path(key: dict[str, Any]) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return profiles_dir() / f"{name}.json"


def load_or_measure(model: str | None, dtype: str = "float32", device: str = "cpu", *, kv_cache_dtype: str = "auto",
                    refresh: bool = False, progress: bool = True) -> tuple[Profile, Path, bool]:
    """The cached profile for this model and machine, measured first when there is none (or `refresh`).
    Returns (profile, its file, whether it was measured now)."""
    from pdserve.weights import resolve_model

    model_dir = Path(resolve_model(model, progress=progress))
    key = profile_key(model_dir, dtype, device, kv_cache_dtype)
    path = cache_path(key)
    if path.exists() and not refresh:
        return Profile.from_dict(json.loads(path.read_text())), path, False
    profile = measure(model_dir, dtype, device, key, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=1))
    tmp.replace(path)
    return profile, path, True


def measure(model_dir: Path, dtype: str, device: str, key: dict[str, Any], *, progress: bool = True) -> Profile:
    from datetime import datetime

    from pdserve.models.config import ModelConfig
    from pdserve.weights.hf_dir import read_config

    cfg = ModelConfig.from_hf(read_config(model_dir))
    kv_cache_dtype = key.get("kv_cache_dtype", "auto")
    model = model_sizes(cfg, dtype, kv_cache_dtype)
    units = [1] if device == "cuda" else thread_counts(len(usable_cores()))
    grid = _grid(cfg.max_position_embeddings, model["kv_bytes_per_token"])
    t0 = time.monotonic()
    steps = {}
    for n in units:
        steps[n] = StepTimings.from_dict(_in_child(_step_timings, str(model_dir), dtype, device, n, grid, progress,
                                                   kv_cache_dtype))
    transfer = _in_child(_transfer_timings, model["kv_bytes_per_token"], grid["transfer_mb"], progress, device)
    profile = Profile(key, model, steps, {b: [tuple(p) for p in pts] for b, pts in transfer.items()})
    if device == "cpu" and 1 in steps and len(usable_cores()) >= 2:
        from pdserve.plan.serving_probe import measure_serving

        profile.serving = measure_serving(model_dir, dtype, profile, grid["serving_prompts"], progress)
    profile.date = datetime.now(UTC).isoformat(timespec="seconds")
    profile.seconds = time.monotonic() - t0
    return profile


ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}  # EngineConfig's dtype names


def model_sizes(cfg, dtype: str, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """The profile's model entry: geometry and bytes, the KV's in the KV cache's dtype (element_bytes is the
    KV's: the transfer plan's unit), the recurrent state's in the weights' dtype."""
    elt = ELEMENT_BYTES[dtype]
    kv_elt = elt if kv_cache_dtype == "auto" else ELEMENT_BYTES[kv_cache_dtype]
    return {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "element_bytes": kv_elt, "kv_bytes_per_token": kv_bytes_per_token(cfg, kv_elt),
            "state_bytes_per_request": state_bytes_per_request(cfg, elt), "latent": cfg.mla is not None,
            "max_model_len": cfg.max_position_embeddings}


def kv_bytes_per_token(cfg, element_bytes: int) -> int:
    """K and V of one token in every layer that keeps KV (a hybrid model's recurrent and MLP-only layers keep
    none); MLA's one latent (kv_lora_rank + qk_rope_head_dim: its kv_parts 1, num_kv_heads 1, head_dim the
    latent's width)."""
    return len(cfg.kv_layers(0, cfg.num_layers)) * cfg.kv_parts * cfg.num_kv_heads * cfg.head_dim * element_bytes


def state_bytes_per_request(cfg, element_bytes: int) -> int:
    """The recurrent state one request holds (and a disaggregated one moves): per recurrent layer, the conv's
    last (taps - 1) inputs in the model's dtype and the fp32 SSM state."""
    if cfg.linear_attention is not None:
        s = cfg.linear_attention
        per = s.conv_channels * (s.conv_kernel - 1) * element_bytes + s.num_v_heads * s.k_head_dim * s.v_head_dim * 4
    elif cfg.mamba is not None:
        m = cfg.mamba
        per = m.conv_channels * (m.conv_kernel - 1) * element_bytes + m.num_heads * m.head_dim * m.state_size * 4
    else:
        return 0
    return per * len(cfg.recurrent_layers)


def _grid(max_len: int, kv_bytes_per_token: int) -> dict[str, Any]:
    prefill = [n for n in PREFILL_TOKENS if n <= max_len] or [max_len]
    contexts = [c for c in DECODE_CONTEXTS if c <= max_len] or [max_len]
    points = [(b, c) for b in DECODE_BATCHES for c in contexts if b * c * kv_bytes_per_token <= KV_POOL_CAP_BYTES]
    chunk = min(CHUNK[0], max_len // 4)
    offset = min(CHUNK[1], max_len - chunk)
    return {"prefill": prefill, "decode": points, "chunk": (chunk, offset), "transfer_mb": list(TRANSFER_MB),
            "reps": 3, "serving_prompts": [128, 512] if max_len > 1024 else [max_len // 8, max_len // 2]}


def _answer(fn, args: tuple, answer, parent: int) -> None:
    """In the child: fn(*args), or the error it raised, put on `answer` for the parent. The child dies with
    the parent: `pdserve plan` killed mid-profile must not leave it computing on every core for minutes."""
    die_with_parent(signal.SIGKILL)
    no_named_semaphores()
    if os.getppid() != parent:  # the parent died before the line above
        return
    try:
        answer.put(("ok", fn(*args)))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        answer.put(("error", f"{type(e).__name__}: {e}"))


def _in_child(fn, *args):
    """fn(*args) in a fresh spawned process (its own torch threads and core affinity); its result."""
    ctx = mp.get_context("spawn")
    answer = ctx.Queue()
    proc = ctx.Process(target=_answer, args=(fn, args, answer, os.getpid()), daemon=True)
    proc.start()
    try:
        kind, value = answer.get(timeout=_CHILD_TIMEOUT_S)
    except queue.Empty:
        raise RuntimeError(f"profiling ({fn.__name__}) gave no answer in {_CHILD_TIMEOUT_S:.0f} s") from None
    finally:
        proc.join(timeout=10)
        if proc.is_alive():  # a transfer library that hangs on shutdown: the answer is in already
            proc.kill()
            proc.join()
    if kind == "error":
        raise RuntimeError(f"profiling ({fn.__name__}) failed: {value}")
    return value


def _step_timings(model_dir: str, dtype: str, device: str, threads: int, grid: dict[str, Any],
                  progress: bool, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    import logging

    import torch
    from tqdm.auto import tqdm

    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_runner import SeqStep, StepSpec
    from pdserve.engine.sampler import SampleSpec

    logging.disable(logging.WARNING)
    if device == "cpu" and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, usable_cores()[:threads])
    tpb = 32
    longest = max(grid["prefill"] + [grid["chunk"][0] + grid["chunk"][1]])
    most = max([b * c for b, c in grid["decode"]] + [longest])
    blocks = -(-most // tpb) + max((b for b, _ in grid["decode"]), default=1) + 1
    ecfg = EngineConfig(model=model_dir, dtype=dtype, device=device, num_threads=threads if device == "cpu" else None,
                        tokens_per_block=tpb, num_kv_blocks=blocks, max_num_tokens=longest,
                        enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    engine = LLMEngine(ecfg)
    runner, vocab = engine.runner, engine.model_cfg.vocab_size
    rng = torch.Generator().manual_seed(0)
    greedy = SampleSpec(temperature=0.0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=rng).tolist()

    def timed(seqs: list[SeqStep], reps: int = grid["reps"]) -> float:
        """Median seconds of `reps` steps, after one untimed step of the same shape (first-call costs)."""
        runner.step(StepSpec(seqs))
        times = []
        for _ in range(reps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.step(StepSpec(seqs))
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def table(start_block: int, n_tokens: int) -> list[int]:
        return list(range(start_block, start_block + -(-n_tokens // tpb)))

    work = len(grid["prefill"]) + 1 + len(grid["decode"])
    bar = tqdm(total=work, desc=f"profiling {threads} {'thread' if device == 'cpu' else 'GPU'}(s)", unit="shape",
               disable=not progress)
    try:
        prefill = {}
        for n in grid["prefill"]:
            prefill[n] = timed([SeqStep(tokens(n), 0, table(0, n + 1), greedy)])
            bar.update()
        chunk, offset = grid["chunk"]
        chunk_s = timed([SeqStep(tokens(chunk), offset, table(0, offset + chunk + 1), greedy)])
        bar.update()
        decode = {}
        for b, ctx in grid["decode"]:
            per = -(-ctx // tpb)
            seqs = [SeqStep(tokens(1), ctx - 1, table(i * per, ctx), greedy) for i in range(b)]
            decode[(b, ctx)] = timed(seqs, reps=2 * grid["reps"] + 1)
            bar.update()
    finally:
        bar.close()
        engine.shutdown()
    return StepTimings(threads, prefill, (chunk, offset, chunk_s), decode).to_dict()


def nixl_installed() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("nixl_cu12", "nixl_cu13"))


def transfer_backends(device: str) -> list[str]:
    """The backends whose writes the profile times on `device`: shm moves host memory only, so on CUDA
    (the instances' KV pools in VRAM) only nixl can."""
    if device == "cuda":
        return ["nixl"] if nixl_installed() else []
    return ["shm"] + (["nixl"] if nixl_installed() else [])


def default_backend(device: str) -> str:
    """`pdserve plan`'s --backend when none is named: what the device's pools can be moved with."""
    return "nixl" if device == "cuda" else "shm"


class _Pool:
    """A registered buffer for the transfer timings: host shared memory, or VRAM on CUDA."""

    def __init__(self, nbytes: int, device: str, fill: int):
        if device == "cuda":
            import torch

            self._tensor = torch.full((nbytes,), fill, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            self.ptr = self._tensor.data_ptr()
            self.region = MemoryRegion(self.ptr, nbytes, device_id=self._tensor.device.index or 0)
        else:
            from pdserve.kv_transfer.agents.shm import allocate_shared

            self._buffer = allocate_shared(nbytes)
            self._buffer.numpy()[:] = fill  # the pages faulted in now, not inside the first timed write
            self.ptr, self.region = self._buffer.ptr, self._buffer.region


def _transfer_timings(kv_bytes_per_token: int, sizes_mb: list[int], progress: bool,
                      device: str = "cpu") -> dict[str, list]:
    """Per backend, [(bytes, s)]: one write of a request's KV, one block (32 tokens) per fragment, between
    two pools in the device's memory."""
    import logging

    import numpy as np
    from tqdm.auto import tqdm

    from pdserve.kv_transfer.agents import TransferState, make_agent

    logging.disable(logging.WARNING)
    backends = transfer_backends(device)
    frag = kv_bytes_per_token * 32
    largest = max(sizes_mb) << 20
    out: dict[str, list] = {}
    bar = tqdm(total=len(backends) * len(sizes_mb), desc="profiling KV transfer", unit="size", disable=not progress)
    for backend in backends:
        src_agent = make_agent(backend, f"plan-src-{os.getpid()}")
        dst_agent = make_agent(backend, f"plan-dst-{os.getpid()}")
        src, dst = _Pool(largest + frag, device, 1), _Pool(largest + frag, device, 0)
        src_agent.register_memory(src.region)
        dst_agent.register_memory(dst.region)
        peer = src_agent.load_remote(dst_agent.local_descriptor())
        points = []
        for mb in sizes_mb:
            k = max(1, (mb << 20) // frag)
            offsets = np.arange(k, dtype=np.uint64) * np.uint64(frag)
            sizes = np.full(k, frag, dtype=np.uint64)
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                handle = src_agent.submit_write(peer, offsets + np.uint64(src.ptr), offsets + np.uint64(dst.ptr),
                                                sizes, b"plan")
                while (state := src_agent.poll(handle)) is TransferState.IN_PROGRESS:
                    time.sleep(0.0001)
                if state is not TransferState.DONE:
                    raise RuntimeError(f"{backend} write of {mb} MiB failed")
                times.append(time.perf_counter() - t0)
                src_agent.release(handle)
            dst_agent.get_notifications()
            points.append((k * frag, statistics.median(times[1:])))  # the first one warms the path up
            bar.update()
        out[backend] = points
    bar.close()
    return out


def describe(profile: Profile) -> str:
    """A few lines saying what the profile holds."""
    k = profile.key
    kv = f", KV {k['kv_cache_dtype']}" if "kv_cache_dtype" in k else ""
    lines = [f"profile of {Path(k['model']).name} ({k['dtype']}{kv}, {k['device']}) on {k['machine']}, "
             f"{k['units']} {'cores' if k['device'] == 'cpu' else 'GPUs'}; measured {profile.date} "
             f"in {profile.seconds:.0f} s"]
    for n, t in sorted(profile.steps.items()):
        longest = max(t.prefill)
        b1 = min(t.decode, default=None)
        decode = f", decode b{b1[0]} ctx {b1[1]} {1000 * t.decode[b1]:.1f} ms" if b1 else ""
        lines.append(f"  {n} {'thread' if k['device'] == 'cpu' else 'GPU'}(s): prefill {longest} tokens "
                     f"{1000 * t.prefill[longest]:.0f} ms{decode}")
    for backend, pts in profile.transfer.items():
        n, s = pts[-1]
        where = "VRAM to VRAM" if k["device"] == "cuda" else "host memory"
        lines.append(f"  KV transfer {backend} ({where}): {n / 2**20:.0f} MiB in {1000 * s:.1f} ms "
                     f"({n / s / 1e9:.1f} GB/s)")
    if not profile.transfer:
        lines.append("  KV transfer: not measured (on CUDA only nixl moves VRAM; install nixl-cu12 or nixl-cu13)")
    return "\n".join(lines)


__all__ = ["Profile", "StepTimings", "describe", "load_or_measure", "measure", "thread_counts"]
