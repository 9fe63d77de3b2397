"""Host memory copies of fragment lists, shared by the fake and shm agents and the bounce buffer.

A fragment list is three parallel uint64 arrays (dst, src, sizes) of absolute addresses in this
process. Large fragments go one `memmove` each (ctypes releases the GIL during the call). Many
equal-sized small fragments (the NHD head-mismatch shape: one per layer, K/V and token) would cost a
Python call each, so they are moved as rows of a strided 2-D view, one numpy row gather per batch:

    side memory:  lo ──┬── g ──┬── g ──┬── ...        g = gcd of every (ptr - lo): the row pitch
    row view:     [rows, size // w] words of w bytes, strides (g, w)   (rows may overlap; only
                  the rows a fragment starts at are touched, and fragments never overlap)

Indexing by row (n indices) rather than by word (n * size / w indices) keeps the index arrays and
the temporaries small: for 491,520 fragments of 128 B that is ~4 MiB of indices instead of ~60 MiB,
which matters because fresh large temporaries cost a page fault per 4 KiB. When one side is packed
(the bounce staging segment: consecutive rows in plan order) the rows move with no temporary at all.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

# Below this many fragments a plain loop is cheaper than building index arrays.
_VECTORISE_MIN_FRAGMENTS = 256
# Fragments larger than this are bandwidth-bound anyway; memmove each.
_VECTORISE_MAX_FRAGMENT_BYTES = 4096
# Payload bytes moved per numpy call: bounds the temporaries of the unpacked case to ~64 MiB.
_BATCH_BYTES = 64 << 20
_WORDS = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}


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
            _copy_rows(np.asarray(dst, np.uint64), np.asarray(src, np.uint64), uniform)
            return
    for d, s, z in zip(dst.tolist(), src.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, z)


def gather_packed(dst_ptr: int, src: np.ndarray, size: int) -> None:
    """Fragments of `size` bytes at src[i] -> rows packed back to back at dst_ptr + i * size."""
    if len(src):
        s = _Rows(np.asarray(src, np.uint64), size)
        word = math.gcd(s.pitch, size, s.lo, dst_ptr, 8)
        # numpy writes straight into the packed rows (mode="clip" skips the bounds pass and the
        # buffering that mode="raise" implies; the indices are in range by construction).
        np.take(s.view(size, word), s.index, axis=0, out=_packed(dst_ptr, len(src), size, word), mode="clip")


def scatter_packed(dst: np.ndarray, src_ptr: int, size: int) -> None:
    """Rows packed back to back at src_ptr + i * size -> fragments of `size` bytes at dst[i]."""
    if len(dst):
        d = _Rows(np.asarray(dst, np.uint64), size)
        word = math.gcd(d.pitch, size, d.lo, src_ptr, 8)
        d.view(size, word)[d.index] = _packed(src_ptr, len(dst), size, word)


def _packed(ptr: int, n: int, size: int, word: int) -> np.ndarray:
    return host_view(ptr, n * size, _WORDS[word]).reshape(n, size // word)


class _Rows:
    """One side of a uniform copy: a strided [rows, size // word] view and each fragment's row."""

    def __init__(self, ptrs: np.ndarray, size: int) -> None:
        self.lo = int(ptrs.min())
        offsets = ptrs - np.uint64(self.lo)
        self.pitch = int(np.gcd.reduce(offsets)) or size  # 0 only for a single fragment
        self.span = int(offsets.max()) + size
        self.index = (offsets // np.uint64(self.pitch)).astype(np.intp)

    def view(self, size: int, word: int) -> np.ndarray:
        """`word` divides lo, pitch and size, so the view is word-aligned."""
        flat = host_view(self.lo, self.span, _WORDS[word])
        rows = (self.span - size) // self.pitch + 1
        return np.lib.stride_tricks.as_strided(flat, (rows, size // word), (self.pitch, word), writeable=True)


def _is_packed(ptrs: np.ndarray, size: int) -> bool:
    """Fragments back to back in order (a bounce segment's payload)."""
    return bool((np.diff(ptrs) == np.uint64(size)).all())


def _copy_rows(dst: np.ndarray, src: np.ndarray, size: int) -> None:
    if _is_packed(dst, size):
        gather_packed(int(dst[0]), src, size)
        return
    if _is_packed(src, size):
        scatter_packed(dst, int(src[0]), size)
        return
    d, s = _Rows(dst, size), _Rows(src, size)
    word = math.gcd(d.pitch, s.pitch, size, d.lo, s.lo, 8)
    dst_rows, src_rows = d.view(size, word), s.view(size, word)
    step = max(1, _BATCH_BYTES // size)
    for start in range(0, len(d.index), step):
        dst_rows[d.index[start:start + step]] = src_rows[s.index[start:start + step]]
