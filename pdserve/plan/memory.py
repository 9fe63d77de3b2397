"""`pdserve plan --model` a config.json without weights: what the config alone says about serving the model.

A published model's config.json (or a directory holding only it) fixes every rank's memory: the weights at the
serving dtype, the KV pool, the recurrent state (engine/footprint.py, the numbers `pdserve serve` checks before
loading). It does not fix the step times the ranked plan is made of: those are measured by running the model
(profile.py), which needs its weights. So for such a model `pdserve plan` prints, for each TP x PP layout the
model can take, what a rank holds and whether this machine has the memory, and says what it cannot say.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.config import EngineConfig
from pdserve.engine.footprint import GIB, available_bytes, footprint, layouts
from pdserve.models.config import ModelConfig
from pdserve.plan.profile import ELEMENT_BYTES, kv_bytes_per_token, state_bytes_per_request
from pdserve.weights.hf_dir import CONFIG_FILE, INDEX_FILE, read_json


def config_only(model: str | None) -> Path | None:
    """The config.json `model` names when it is that file, or a directory with it and no weights; else None."""
    if model is None:
        return None
    p = Path(model).expanduser()
    if p.is_file() and p.name.endswith(".json"):
        return p
    if p.is_dir() and (p / CONFIG_FILE).is_file() and not (p / INDEX_FILE).is_file() \
            and not any(p.glob("*.safetensors")) and not any(p.glob("*.gguf")):
        return p / CONFIG_FILE
    return None


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def memory_report(args: argparse.Namespace, config: Path) -> str:
    cfg = ModelConfig.from_hf(read_json(config))
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    ecfg = EngineConfig(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                        kv_cache_memory_gb=args.kv_cache_memory_gb)
    elt = ELEMENT_BYTES[args.dtype]
    kv_elt = elt if args.kv_cache_dtype == "auto" else ELEMENT_BYTES[args.kv_cache_dtype]
    kv_layers = len(cfg.kv_layers(0, cfg.num_layers))
    what = (f"MLA latent {cfg.head_dim} wide, whole on every TP rank" if cfg.mla is not None else
            f"{cfg.num_kv_heads} KV heads of {cfg.head_dim}, cut over TP")
    state = state_bytes_per_request(cfg, elt)
    available = available_bytes(device)
    if device == "cuda":
        import torch

        units = torch.cuda.device_count()
        here = f"cuda, {units} device(s), {available / GIB:.1f} GiB free on the smallest; a rank per device"
    else:
        import os

        units = len(os.sched_getaffinity(0))
        here = f"cpu, {available / GIB:.1f} GiB available (MemAvailable), shared by every rank"
    lines = [f"{cfg.architecture} from {config} (config.json only: memory, no timings)",
             f"  {cfg.num_layers} layers, {kv_layers} keep KV: {_size(kv_bytes_per_token(cfg, kv_elt))} of KV a token "
             f"in all ({what}; {args.kv_cache_dtype if args.kv_cache_dtype != 'auto' else args.dtype})"
             + (f"; recurrent state {_size(state)} a request" if state else "")
             + f"; context {cfg.max_position_embeddings} tokens",
             f"  weights at {args.dtype}, a KV pool of kv_cache_memory_gb={args.kv_cache_memory_gb} a rank; this "
             f"machine: {here}", ""]
    head = (f"{'layout':<10} {'ranks':>5}  {'weights/rank':>12}  {'KV pool/rank':>12}  {'state/rank':>10}  "
            f"{'all ranks':>10}  {'pool tokens':>11}  {'KV tokens that fit':>18}  fits here")
    lines += ["memory per rank (the largest rank of each layout; GiB)", head, "-" * len(head)]
    copies = False
    for tp, pp in layouts(cfg, args.max_ranks):
        fp = footprint(cfg, ecfg, device, tp=tp, pp=pp)
        r = fp.largest
        copies = copies or r.cpu_copies > 0
        fit = _tokens_that_fit(fp, device, available)
        if device == "cuda" and tp * pp > units:
            fits = f"no: {tp * pp} GPUs, {units} here"
        else:
            fits = "yes" if fit >= fp.num_kv_blocks * fp.tokens_per_block else "no: memory"
        lines.append(f"{f'TP{tp} PP{pp}':<10} {tp * pp:>5}  {(r.weights + r.cpu_copies) / GIB:>12.2f}  "
                     f"{r.kv_pool / GIB:>12.2f}  {r.state / GIB:>10.2f}  {fp.total / GIB:>10.1f}  "
                     f"{fp.num_kv_blocks * fp.tokens_per_block:>11}  {max(fit, 0):>18}  {fits}")
    lines += ["", "KV tokens that fit: the pool's tokens if the rest of this machine's memory held it (every rank "
              "holds as many blocks)."]
    if copies:
        lines.append("weights/rank counts the CPU's second copy of the linear weights (cpu_decode_gemv).")
    lines.append("Without the weights, pdserve plan cannot rank deployments or write a cluster.yaml: their prefill, "
                 "decode and transfer times are measured by running the model (the profile). Give --model the "
                 "directory with the weights for that.")
    return "\n".join(lines)


def _tokens_that_fit(fp, device: str, available: int) -> int:
    """The KV tokens every rank could pool if the memory its weights and state leave went to the pool."""
    per_token = [r.kv_pool / (fp.num_kv_blocks * fp.tokens_per_block) for r in fp.ranks]
    if device == "cpu":  # one host's memory for every rank
        rest = available - sum(r.weights + r.cpu_copies + r.state for r in fp.ranks)
        tokens = rest / sum(per_token) if sum(per_token) else 0
    else:
        tokens = min(((available - r.weights - r.state) / t for r, t in zip(fp.ranks, per_token) if t), default=0)
    return int(tokens) // fp.tokens_per_block * fp.tokens_per_block
