"""Host memory copies of fragment lists, shared by the fake and shm agents and the bounce buffer.

A fragment list is three parallel uint64 arrays (dst, src, sizes) of absolute addresses in this
process. Large fragments go one `memmove` each (ctypes releases the GIL during the call). Many
equal-sized small fragments (the NHD head-mismatch shape: one per layer, K/V and token) would cost a
Python call each, so they are moved as one numpy fancy-index gather/scatter over word views.
"""

from __future__ import annotations

import ctypes

import numpy as np

# Below this many fragments a plain loop is cheaper than building index arrays.
_VECTORISE_MIN_FRAGMENTS = 256
# Fragments larger than this are bandwidth-bound anyway; memmove each.
_VECTORISE_MAX_FRAGMENT_BYTES = 4096
# Index elements per batch (bounds the temporary index array to ~64 MiB).
_BATCH_ELEMENTS = 8 << 20


def host_view(ptr: int, nbytes: int, dtype=np.uint8) -> np.ndarray:
    """A writable numpy view of [ptr, ptr + nbytes) in this process (no copy, no ownership)."""
    itemsize = np.dtype(dtype).itemsize
    assert ptr % itemsize == 0 and nbytes % itemsize == 0, (ptr, nbytes, itemsize)
    buf = (ctypes.c_char * nbytes).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype)


def copy_fragments(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> None:
    """memmove(dst[i], src[i], sizes[i]) for every i; regions are assumed valid and non-overlapping."""
    n = len(sizes)
    if n == 0:
        return
    if n >= _VECTORISE_MIN_FRAGMENTS and int(sizes.max()) <= _VECTORISE_MAX_FRAGMENT_BYTES:
        uniform = int(sizes[0])
        if bool((sizes == uniform).all()):
            word = _word_size(uniform, dst, src)
            _copy_uniform(dst, src, uniform, word)
            return
    for d, s, z in zip(dst.tolist(), src.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, z)


def _word_size(size: int, dst: np.ndarray, src: np.ndarray) -> int:
    for word in (8, 4, 2):
        if size % word == 0 and not (dst % word).any() and not (src % word).any():
            return word
    return 1


def _copy_uniform(dst: np.ndarray, src: np.ndarray, size: int, word: int) -> None:
    dtype = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}[word]
    dst_lo, src_lo = int(dst.min()), int(src.min())
    dst_view = host_view(dst_lo, int(dst.max()) + size - dst_lo, dtype)
    src_view = host_view(src_lo, int(src.max()) + size - src_lo, dtype)
    dst_words = ((dst - dst_lo) // word).astype(np.int64)
    src_words = ((src - src_lo) // word).astype(np.int64)
    per = size // word
    lane = np.arange(per, dtype=np.int64)
    step = max(1, _BATCH_ELEMENTS // per)
    for start in range(0, len(dst_words), step):
        d = dst_words[start:start + step, None] + lane
        s = src_words[start:start + step, None] + lane
        dst_view[d] = src_view[s]
