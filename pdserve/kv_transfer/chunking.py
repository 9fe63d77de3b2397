"""Pipelined transfer: which blocks one prefill chunk ships.

The sender ships finished prefill blocks chunk by chunk; the receiver always posts one whole
slice (all its block ids once) and the sender blanks (-1) what a chunk does not ship.

    prompt tokens:  |<- reused ->|<- chunk 1 ->|<- chunk 2 ->|<- chunk 3 (final) ->|
    blocks (T=4):   [0   ][1   ][2   ][3   ][4   ][5   ][6   ][7 ..partial]
    chunk 1 ships blocks [0, first full block boundary after its end): the reused prefix rides along
    chunk 2 ships from where chunk 1 stopped (a partial block waits for the next chunk)
    chunk 3 ships the rest, rounding up to include the partial last block

- A non-final chunk ships only full blocks: ``[start // T, end // T)``.
- The first chunk starts at block 0, so a reused (prepopulated) prefix rides with it.
- The final chunk rounds its end up and is sent even when it holds no full block.
- Sliding-window groups whose window is shorter than the prompt ship nothing until the final
  chunk, then all their (final-window) blocks at once: their pages may leave the window between
  chunks. A window >= prompt length behaves as full attention.
- A recurrent group (one state slot per sequence, ``recurrent``) ships its slot with the final chunk
  only: the state is a checkpoint after exactly the tokens seen, and only the final chunk ends at one
  that the transfer delivers (the prompt length). Before it, the slot holds a state the receiver must
  not take as any block-rounded end.
- The token span a chunk delivers is exact: the final chunk ends at the prompt length, not at a
  block boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np


@dataclass(frozen=True, eq=False)
class Chunk:
    block_ids: dict[int, np.ndarray]  # layer group id -> this side's ids, -1 where not shipped now
    token_start: int  # exact token span [token_start, token_end) this chunk delivers
    token_end: int
    is_first: bool
    is_last: bool

    @property
    def should_send(self) -> bool:
        """The final chunk always goes (the receiver waits for it); others only with blocks."""
        return self.is_last or any(bool((ids >= 0).any()) for ids in self.block_ids.values())


def chunk_blocks(
    block_ids: Mapping[int, np.ndarray],
    sliding_windows: Mapping[int, int | None],
    *,
    tokens_per_block: int,
    chunk_start: int,
    chunk_end: int,
    prompt_len: int,
    reused_len: int = 0,
    recurrent: frozenset[int] = frozenset(),
) -> Chunk:
    """Blocks that the prefill chunk ``[chunk_start, chunk_end)`` ships (see module docstring).

    ``block_ids``: the sender's ids per layer group (block i holds tokens [i*T, (i+1)*T)).
    ``sliding_windows``: per layer group, its window in tokens or None for full attention.
    ``reused_len``: prompt tokens already in the cache before prefill (the first chunk starts there).
    ``recurrent``: layer groups whose ids are one state slot (their window is None), shipped last.
    """
    t = tokens_per_block
    if t < 1:
        raise ValueError(f"tokens_per_block={t} must be positive")
    if not 0 <= reused_len <= chunk_start < chunk_end <= prompt_len:
        raise ValueError(
            f"need 0 <= reused_len ({reused_len}) <= chunk_start ({chunk_start}) < chunk_end ({chunk_end}) "
            f"<= prompt_len ({prompt_len})"
        )
    missing = set(block_ids) ^ set(sliding_windows)
    if missing:
        raise ValueError(f"block_ids and sliding_windows name different layer groups: {sorted(missing)}")
    is_first = chunk_start == reused_len
    is_last = chunk_end == prompt_len
    first_block = 0 if is_first else chunk_start // t
    end_block = -(-chunk_end // t) if is_last else chunk_end // t
    out = {}
    for gid, ids in block_ids.items():
        ids = np.asarray(ids)
        if gid in recurrent:
            if ids.shape != (1,):
                raise ValueError(f"recurrent layer group {gid}: one state slot id, got {ids.size}")
            out[gid] = ids.copy() if is_last else np.full_like(ids, -1)
            continue
        if ids.ndim != 1 or ids.size * t < prompt_len:
            raise ValueError(
                f"layer group {gid}: {ids.size} block ids of {t} tokens cannot hold a {prompt_len}-token prompt"
            )
        window = sliding_windows[gid]
        if window is not None and window < prompt_len:
            out[gid] = ids.copy() if is_last else np.full_like(ids, -1)
        else:
            chunk = np.full_like(ids, -1)
            chunk[first_block:end_block] = ids[first_block:end_block]
            out[gid] = chunk
    token_end = min(end_block * t, prompt_len)
    return Chunk(out, min(first_block * t, token_end), token_end, is_first, is_last)
