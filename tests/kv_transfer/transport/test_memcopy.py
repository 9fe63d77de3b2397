"""copy_fragments row paths: packed gather, packed scatter, strided and overlapping row views."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from pdserve.kv_transfer.agents.memcopy import copy_fragments


def _expected(dst: np.ndarray, src: np.ndarray, doffs, soffs, size: int) -> np.ndarray:
    out = dst.copy()
    for d, s in zip(doffs.tolist(), soffs.tolist()):
        out[d:d + size] = src[s:s + size]
    return out


@pytest.mark.parametrize("case", ["gather_packed", "scatter_packed", "both_strided", "overlapping_rows", "odd"])
def test_uniform_row_copies_match_memmove(case):
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))  # hash() varies with PYTHONHASHSEED
    n, size = 1000, 24
    src = rng.integers(0, 255, 1 << 18, dtype=np.uint8)
    dst = np.zeros(1 << 18, dtype=np.uint8)
    strided = np.sort(rng.permutation(len(src) // (3 * size))[:n]).astype(np.uint64) * (3 * size)
    packed = np.arange(n, dtype=np.uint64) * size
    if case == "gather_packed":  # the bounce sender: scattered KV rows -> one packed payload
        soffs, doffs = rng.permutation(strided), packed + 40
    elif case == "scatter_packed":  # the bounce receiver: packed payload -> scattered KV rows
        soffs, doffs = packed + 16, rng.permutation(strided)
    elif case == "both_strided":
        soffs, doffs = strided, rng.permutation(strided)
    elif case == "overlapping_rows":  # row pitch (8) < fragment size (24): the row views overlap
        soffs = np.arange(n, dtype=np.uint64) * 48 + 8
        doffs = rng.permutation(np.arange(n, dtype=np.uint64) * 32)
    else:  # odd sizes and odd addresses: byte rows
        size = 7
        soffs, doffs = strided + 3, rng.permutation(packed * 3 + 1)
    want = _expected(dst, src, doffs, soffs, size)
    copy_fragments(dst.ctypes.data + doffs, src.ctypes.data + soffs, np.full(n, size, np.uint64))
    np.testing.assert_array_equal(dst, want)
