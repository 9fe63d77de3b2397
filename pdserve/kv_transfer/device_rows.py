"""Row gathers and scatters on a KV pool's own device (torch): the bounce path when the KV lives in
GPU memory, where a CPU copy cannot reach it.

A fragment list of equal-sized fragments (the head-mismatch shape: NHD always, HND where heads split)
is a set of rows of one strided view of the pool, so one `index_select` packs them into a staging
region and one `index_copy_` unpacks them, each a single kernel on the pool's device:

    pool:     lo ──┬── p ──┬── p ──┬── ...        p = gcd of every (ptr - lo): the row pitch
    rows:     [ (span - size) / p + 1, size / w ]  words of w bytes, strides (p / w, 1)
    staging:  [ n, size / w ]                      packed, in plan order

Addresses are absolute in this process, as the transfer agent registered them; `region_tensor` turns
an address range into a tensor without copying (CUDA: through `__cuda_array_interface__`). The same
functions run on CPU tensors, which is how the tests check them byte for byte without a GPU; the
host bounce path keeps numpy's row copies (agents/memcopy.py), which torch's CPU `index_select`
does not match (2 ms vs 15 ms for 30,720 rows of 128 B on the 2-core VM).
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class _DeviceMemory:
    """Exposes [ptr, ptr + nbytes) of GPU memory to `torch.as_tensor` (no copy, no ownership)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}


def region_tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over [ptr, ptr + nbytes) on `device` (shares the memory)."""
    if device.type == "cpu":
        return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=torch.uint8)
    return torch.as_tensor(_DeviceMemory(ptr, nbytes), device=device)


def copy_in(ptr: int, data: np.ndarray, device: torch.device) -> None:
    """Host bytes -> [ptr, ptr + data.nbytes) on `device`."""
    raw = np.ascontiguousarray(data).view(np.uint8)
    if raw.size:
        region_tensor(ptr, raw.size, device).copy_(torch.from_numpy(raw))


def copy_out(ptr: int, nbytes: int, device: torch.device) -> np.ndarray:
    """[ptr, ptr + nbytes) on `device` -> a host uint8 array of our own."""
    return region_tensor(ptr, nbytes, device).cpu().numpy().copy()


def synchronize(device: torch.device) -> None:
    """Wait for this thread's queued copies on `device`: the bytes are in place for a peer's read or write."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class _Rows:
    """One side's fragments of `size` bytes as rows of a strided view of the memory that holds them."""

    def __init__(self, ptrs: np.ndarray, size: int, *other: int) -> None:
        ptrs = np.asarray(ptrs, dtype=np.uint64)
        self.lo = int(ptrs.min())
        offsets = ptrs - np.uint64(self.lo)
        self.pitch = int(np.gcd.reduce(offsets)) or size  # 0 only for one fragment
        self.span = int(offsets.max()) + size
        self.word = math.gcd(self.lo, self.pitch, size, *other, 8)
        self.index = (offsets // np.uint64(self.pitch)).astype(np.int64)
        self.size = size

    def view(self, device: torch.device) -> torch.Tensor:
        words = region_tensor(self.lo, self.span, device).view(_WORDS[self.word])
        rows = (self.span - self.size) // self.pitch + 1
        return words.as_strided((rows, self.size // self.word), (self.pitch // self.word, 1))

    def index_on(self, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(self.index).to(device)


def _packed(ptr: int, n: int, size: int, word: int, device: torch.device) -> torch.Tensor:
    return region_tensor(ptr, n * size, device).view(_WORDS[word]).view(n, size // word)


def gather_rows(dst_ptr: int, src_ptrs: np.ndarray, size: int, device: torch.device) -> None:
    """Fragments of `size` bytes at src_ptrs[i] -> rows packed back to back at dst_ptr + i * size."""
    if len(src_ptrs) == 0:
        return
    src = _Rows(src_ptrs, size, dst_ptr)
    out = _packed(dst_ptr, len(src_ptrs), size, src.word, device)
    torch.index_select(src.view(device), 0, src.index_on(device), out=out)


def scatter_rows(dst_ptrs: np.ndarray, src_ptr: int, size: int, device: torch.device) -> None:
    """Rows packed back to back at src_ptr + i * size -> fragments of `size` bytes at dst_ptrs[i]
    (which never overlap one another)."""
    if len(dst_ptrs) == 0:
        return
    dst = _Rows(dst_ptrs, size, src_ptr)
    payload = _packed(src_ptr, len(dst_ptrs), size, dst.word, device)
    index = dst.index_on(device)
    if dst.pitch >= dst.size:  # rows of the view are disjoint: one row copy per fragment
        dst.view(device).index_copy_(0, index, payload)
        return
    # Fragments closer than their size to a neighbour's start (a pitch below the size) overlap as rows
    # of the view, which an in-place kernel refuses: address their words one by one instead.
    per = dst.size // dst.word
    words = region_tensor(dst.lo, dst.span, device).view(_WORDS[dst.word])
    cols = torch.arange(per, device=device)
    words.index_copy_(0, (index[:, None] * (dst.pitch // dst.word) + cols).reshape(-1), payload.reshape(-1))
