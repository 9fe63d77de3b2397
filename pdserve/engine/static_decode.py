"""The static-shape decode step, which CUDA captures as a graph once per batch bucket and replays.

An eager decode step builds its input tensors from Python lists (one host -> device copy each), runs
~30 kernels a layer, and reads the logits back row by row to sample: on a GPU its time is the host's
launches and synchronisations, not the device's work (docs/benchmarks.md, "CUDA"). This step instead
keeps every input in one preallocated device buffer, written by one copy from pinned host memory, pads
the batch to the smallest bucket that holds it, samples on the device (static_sampler.py) and reads
the step's tokens back once, at the end. Nothing in between reads a tensor's value on the host, so on
CUDA the whole step, sampling included, is one graph replay.

    host: fill the staging buffer (tokens, positions, slots, block tables, lengths, sampling inputs)
          -> one copy to the device buffer -> replay graph[bucket] -> one read of [rows, columns]

    device buffer (int64; the sampling floats are float64 bits), R = the largest bucket, W = table width:
      ids[R] positions[R] slot_blocks[R] slot_offsets[R] lens[R] ints[3, R] floats[4, R] table[R, W]

A padding row decodes token 0 at position 0 into the pool's spare block (a row the model runner keeps
past the cache manager's blocks, so no request's KV is touched) and attends to that one key; its token
is dropped. The table is as wide as the context window: attention reads only each row's `lens` keys.

It applies to one rank (TP and PP 1: another rank's collectives would have to be captured too), the
Llama-family decoder without MoE layers (expert routing is data-dependent), steps whose every row
decodes one token and samples without a logit processor (static_sampler.static_row), at most the
largest bucket of rows. Every other step, mixed prefill + decode ones included, runs eagerly. On CPU it
runs only where `static_decode_on_cpu` forces it, without graphs: there it proves, on every CI run,
that this step gives the eager step's tokens.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch

from pdserve.engine.sampler import SampleResult
from pdserve.engine.sampling_params import GREEDY_BELOW
from pdserve.engine.static_sampler import (FLOAT_FIELDS, INT_FIELDS, Columns, fill_padding, fill_rows, read_result,
                                           sample_static, static_row)
from pdserve.models.attention import AttentionMetadata, PagedKVCache, fused_decode
from pdserve.models.layers import decode_step
from pdserve.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def applies(ecfg, model, ps, device: torch.device) -> bool:
    """Whether this rank decodes through the static step (see the module docstring for why not elsewhere).
    On CUDA it needs the Triton decode kernel, which reads each row's keys only: the PyTorch path (an FP8
    pool's, or without Triton) would gather the table's whole width, the context window, every layer."""
    on = ecfg.cuda_graphs if device.type == "cuda" else ecfg.static_decode_on_cpu
    if on and device.type == "cuda" and (ecfg.kv_cache_dtype == "fp8_e4m3" or fused_decode() is None):
        log.info("CUDA graphs off: decode attention over %s takes the PyTorch path",
                 "an FP8 KV cache" if ecfg.kv_cache_dtype == "fp8_e4m3" else "a pool without Triton")
        return False
    return (on and ps.world_size == 1 and type(model) is LlamaForCausalLM
            and not any(model.cfg.is_moe(i) for i in range(model.cfg.num_layers)))


def for_runner(ecfg, model, cache: PagedKVCache, device: torch.device, max_model_len: int,
               pad_block: int) -> StaticDecode:
    """The step of a rank where `applies`; on CUDA every bucket's greedy graph is captured now."""
    T = ecfg.tokens_per_block
    step = StaticDecode(model, cache, device, ecfg.cuda_graph_batch_sizes or default_buckets(ecfg.max_num_seqs),
                        -(-max_model_len // T), pad_block, graphs=device.type == "cuda")
    if step.graphs:
        step.capture_all()
    return step


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (capped at 256), and max_num_seqs itself."""
    top = min(max_num_seqs, 256)
    sizes = [n for n in (1, 2, 4) if n < top] + list(range(8, top + 1, 8))
    return sorted(set(sizes) | {top})


class StaticDecode:
    """The padded, host-sync-free decode step of one model; see the module docstring. `seqs` are the
    model runner's SeqStep rows (token_ids, start_pos, block_ids, sample, state_slot)."""

    def __init__(self, model, cache: PagedKVCache, device: torch.device, buckets: list[int], max_blocks: int,
                 pad_block: int, graphs: bool):
        if graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.cache, self.device = model, cache, device
        self.buckets = sorted(set(buckets))
        self.vocab = model.cfg.vocab_size
        self.pad_block = pad_block
        self.graphs = graphs
        # CUDA divides by a host scalar as a multiply by its reciprocal; the CPU divides (static_sampler.fill_row)
        self.reciprocal = device.type == "cuda"
        R, W = self.buckets[-1], max_blocks
        self.rows, self.width = R, W
        n = 5 * R + len(INT_FIELDS) * R + R * W + len(FLOAT_FIELDS) * R
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.dev = torch.zeros(n, dtype=torch.int64, device=device) if device.type == "cuda" else self.host
        self._h = self._fields(self.host.numpy())  # numpy views the host fills
        self._d = self._fields(self.dev)  # the same fields on the device, which the step reads
        self._row_ids = torch.arange(R, device=device)
        cache.pool[pad_block].zero_()  # (an allocator's pool may start as anything)
        self._graphs: dict[tuple[int, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        self.steps: Counter[int] = Counter()  # steps this path ran, by bucket (graph replays and eager runs alike)
        self.replays = 0  # of which graph replays

    def _fields(self, buf):
        R, W = self.rows, self.width
        out, at = {}, 0
        for name, size, shape in (("ids", R, (R,)), ("positions", R, (R,)), ("slot_blocks", R, (R,)),
                                  ("slot_offsets", R, (R,)), ("lens", R, (R,)),
                                  ("ints", len(INT_FIELDS) * R, (len(INT_FIELDS), R)),
                                  ("floats", len(FLOAT_FIELDS) * R, (len(FLOAT_FIELDS), R)), ("table", R * W, (R, W))):
            view = buf[at:at + size]
            if name == "floats":
                view = view.view(np.float64) if isinstance(buf, np.ndarray) else view.view(torch.float64)
            out[name] = view.reshape(shape)
            at += size
        self._table_at = at - R * W  # the table is last: a step copies its first rows only
        return out

    # -- which steps ---------------------------------------------------------------------------

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, seqs) -> bool:
        """Whether this path takes the step: decode rows only, each sampling statically, few enough."""
        return (0 < len(seqs) <= self.rows
                and all(len(s.token_ids) == 1 and s.start_pos > 0 and s.state_slot < 0 and static_row(s.sample)
                        for s in seqs))

    # -- the step ------------------------------------------------------------------------------

    def step(self, seqs) -> SampleResult:
        """Run `seqs` (fits() holds) and return their samples, as sampler.sample would."""
        n = len(seqs)
        b = self.bucket(n)
        specs = [s.sample for s in seqs]
        key = (b, any(s.temperature >= GREEDY_BELOW for s in specs), any(s.logprobs is not None for s in specs))
        if self.graphs and key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        self._fill(seqs, b)
        if self.device.type == "cuda":  # pinned: no wait for the host; the table's first b rows only
            used = self._table_at + b * self.width
            self.dev[:used].copy_(self.host[:used], non_blocking=True)
        captured = self._graphs.get(key)
        if captured is not None:
            graph, out = captured
            graph.replay()
            self.replays += 1
        else:
            out = self._run(*key)
        self.steps[b] += 1
        cols = out.shape[1] if key[2] else Columns.status + 1
        return read_result(out[:n, :cols].tolist(), specs)  # the step's one read back

    def _fill(self, seqs, b: int) -> None:
        h, T, n = self._h, self.cache.tokens_per_block, len(seqs)
        positions = [s.start_pos for s in seqs]
        h["ids"][:n] = [s.token_ids[0] for s in seqs]
        h["positions"][:n] = positions
        h["slot_blocks"][:n] = [s.block_ids[p // T] for s, p in zip(seqs, positions)]
        h["slot_offsets"][:n] = [p % T for p in positions]
        h["lens"][:n] = [p + 1 for p in positions]
        table = h["table"]
        for i, (s, p) in enumerate(zip(seqs, positions)):
            used = p // T + 1
            table[i, :used] = s.block_ids[:used]
            table[i, used:] = self.pad_block
        fill_rows(h["ints"], h["floats"], [s.sample for s in seqs], self.vocab, self.reciprocal)
        self._pad(n, b)

    def _pad(self, start: int, stop: int) -> None:
        h = self._h
        for name, value in (("ids", 0), ("positions", 0), ("slot_blocks", self.pad_block), ("slot_offsets", 0),
                            ("lens", 1)):
            h[name][start:stop] = value
        h["table"][start:stop] = self.pad_block
        fill_padding(h["ints"][:, start:stop], h["floats"][:, start:stop], self.vocab)

    def _run(self, b: int, sampling: bool, logprobs: bool) -> torch.Tensor:
        """The step on the device buffer's first b rows -> static_sampler's [b, columns] result."""
        d = self._d
        md = AttentionMetadata(slot_blocks=d["slot_blocks"][:b], slot_offsets=d["slot_offsets"][:b], prefills=[],
                               decode_rows=self._row_ids[:b], decode_blocks=d["table"][:b], decode_lens=d["lens"][:b],
                               tokens_per_block=self.cache.tokens_per_block, decode_only=True)
        with decode_step(True):
            h = self.model(d["ids"][:b], d["positions"][:b], self.cache, md)
        logits = self.model.compute_logits(h)
        return sample_static(logits, d["ints"][:, :b], d["floats"][:, :b], sampling, logprobs, self.reciprocal)

    # -- CUDA graphs ---------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket's greedy graph now (start-up), not inside the first requests' steps."""
        for b in self.buckets:
            key = (b, False, False)
            if key not in self._graphs:
                self._graphs[key] = self._capture(*key)

    def _capture(self, b: int, sampling: bool, logprobs: bool):
        """(graph, its output) for one bucket and sampler variant, or None (logged) where capture fails:
        that variant then runs eagerly on the same buffers."""
        self._pad(0, self.rows)  # warm-up runs execute: only the spare block is written
        self.dev.copy_(self.host)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture: kernel compiles, cuBLAS workspaces
                for _ in range(2):
                    self._run(b, sampling, logprobs)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._run(b, sampling, logprobs)
            return graph, out
        except Exception as e:  # (a capture that fails for any reason leaves the step eager, said)
            log.warning("CUDA graph capture failed for %d rows (sampling=%s, logprobs=%s); those steps run "
                        "eagerly: %s", b, sampling, logprobs, e)
            torch.cuda.synchronize()
            return None
