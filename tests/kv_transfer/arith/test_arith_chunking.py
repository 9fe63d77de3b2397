"""Pipelined-transfer chunk selection, and chunked transfers landing byte-exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer.chunking import chunk_blocks
from pdserve.kv_transfer.write_plan import plan_write
from pdserve.testing.kv_oracle import (
    ModelShape,
    Topology,
    count_writes,
    execute_plan,
    logical_kv,
    make_instance,
    scatter_logical_kv,
)

IDS = {0: np.arange(8) + 10, 1: np.arange(8) + 20}
WINDOWS = {0: None, 1: 8}


def _shipped(chunk, gid):
    return np.flatnonzero(chunk.block_ids[gid] >= 0).tolist()


def test_chunks_exact():
    """tpb 4, prompt 30, 6 reused tokens, prefill chunks [6,13) [13,22) [22,30)."""
    kw = dict(tokens_per_block=4, prompt_len=30, reused_len=6)
    c1 = chunk_blocks(IDS, WINDOWS, chunk_start=6, chunk_end=13, **kw)
    c2 = chunk_blocks(IDS, WINDOWS, chunk_start=13, chunk_end=22, **kw)
    c3 = chunk_blocks(IDS, WINDOWS, chunk_start=22, chunk_end=30, **kw)
    # The reused prefix rides with the first chunk; the partial block 3 waits for chunk 2.
    assert (_shipped(c1, 0), c1.token_start, c1.token_end, c1.is_first, c1.is_last) == ([0, 1, 2], 0, 12, True, False)
    assert (_shipped(c2, 0), c2.token_start, c2.token_end) == ([3, 4], 12, 20)
    # The final chunk rounds up to the partial block, but its token span ends at the prompt.
    assert (_shipped(c3, 0), c3.token_start, c3.token_end, c3.is_last) == ([5, 6, 7], 20, 30, True)
    assert c3.block_ids[0][5:].tolist() == [15, 16, 17]
    # The 8-token window is shorter than the prompt: nothing until the final chunk, then all.
    assert _shipped(c1, 1) == _shipped(c2, 1) == []
    assert _shipped(c3, 1) == list(range(8))


def test_a_recurrent_state_ships_with_the_final_chunk_only():
    """The state slot is the checkpoint after exactly the prompt: chunks [0,13) and [13,22) end at no
    token the transfer delivers as the state's, so only [22,30) ships it, and its span ends at 30, not at
    the block boundary 32."""
    ids = {0: np.arange(8) + 10, 2: np.array([5])}
    kw = dict(tokens_per_block=4, prompt_len=30, recurrent=frozenset({2}))
    chunks = [chunk_blocks(ids, {0: None, 2: None}, chunk_start=a, chunk_end=b, **kw)
              for a, b in ((0, 13), (13, 22), (22, 30))]
    assert [c.block_ids[2].tolist() for c in chunks] == [[-1], [-1], [5]]
    assert chunks[-1].token_end == 30
    with pytest.raises(ValueError, match="recurrent layer group 2: one state slot id, got 2"):
        chunk_blocks({0: np.arange(8), 2: np.array([1, 2])}, {0: None, 2: None}, chunk_start=0, chunk_end=30, **kw)


def test_window_not_shorter_than_prompt_is_positional():
    c = chunk_blocks(IDS, {0: None, 1: 64}, tokens_per_block=4, chunk_start=0, chunk_end=9, prompt_len=30)
    assert _shipped(c, 1) == [0, 1]


def test_final_chunk_sent_without_full_block():
    kw = dict(tokens_per_block=16, prompt_len=10)
    first = chunk_blocks({0: np.array([4])}, {0: None}, chunk_start=0, chunk_end=5, **kw)
    last = chunk_blocks({0: np.array([4])}, {0: None}, chunk_start=5, chunk_end=10, **kw)
    assert not first.should_send and _shipped(first, 0) == []
    assert last.should_send and _shipped(last, 0) == [0] and (last.token_start, last.token_end) == (0, 10)


@pytest.mark.parametrize("kw, match", [
    (dict(chunk_start=5, chunk_end=5, prompt_len=10), "chunk_start"),
    (dict(chunk_start=0, chunk_end=11, prompt_len=10), "prompt_len"),
    (dict(chunk_start=2, chunk_end=5, prompt_len=10, reused_len=3), "reused_len"),
    (dict(chunk_start=0, chunk_end=5, prompt_len=40), "cannot hold a 40-token prompt"),
])
def test_chunk_input_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        chunk_blocks({0: np.arange(2)}, {0: None}, tokens_per_block=16, **kw)


def test_chunk_groups_must_match_windows():
    with pytest.raises(ValueError, match=r"different layer groups: \[1\]"):
        chunk_blocks({0: np.arange(2)}, {0: None, 1: None}, tokens_per_block=16, chunk_start=0, chunk_end=5,
                     prompt_len=20)


@st.composite
def _schedules(draw):
    tpb = draw(st.sampled_from([1, 4, 16]))
    prompt = draw(st.integers(1, 80))
    reused = draw(st.integers(0, prompt - 1))
    cuts = sorted(set(draw(st.lists(st.integers(reused + 1, prompt), max_size=5))) | {prompt})
    return tpb, prompt, reused, [reused] + cuts


@settings(max_examples=100, deadline=None)
@given(_schedules())
def test_chunks_ship_every_block_once(schedule):
    tpb, prompt, reused, cuts = schedule
    n = -(-prompt // tpb)
    ids = {0: np.arange(n), 1: np.arange(n)}
    chunks = [chunk_blocks(ids, {0: None, 1: 1}, tokens_per_block=tpb, chunk_start=a, chunk_end=b,
                           prompt_len=prompt, reused_len=reused) for a, b in zip(cuts, cuts[1:])]
    full = sorted(sum((_shipped(c, 0) for c in chunks), []))
    assert full == list(range(n))
    assert [c.token_start for c in chunks[1:]] == [c.token_end for c in chunks[:-1]]
    assert chunks[0].token_start == 0 and chunks[-1].token_end == prompt
    window_shipped = [_shipped(c, 1) for c in chunks]
    assert window_shipped[-1] == list(range(n))
    assert all(not w for w in window_shipped[:-1])
    assert chunks[-1].should_send and chunks[0].is_first


@pytest.mark.parametrize("ctx_tpb, gen_tpb", [(16, 16), (16, 32), (32, 16)])
def test_chunked_transfer_equals_one_shot(ctx_tpb, gen_tpb):
    """The receiver posts all its ids once; the sender ships chunk by chunk (ctx tp2 -> gen tp1)."""
    model, prompt = ModelShape(num_layer_groups=2, sliding_window=16), 70
    ctx = make_instance("ctx", Topology(tp=2, tokens_per_block=ctx_tpb), model)
    one_shot = make_instance("gen", Topology(tokens_per_block=gen_tpb), model, fill=0xEE)[0]
    chunked = make_instance("gen", Topology(tokens_per_block=gen_tpb), model, fill=0xEE)[0]
    rng = np.random.default_rng(3)
    c_ids = {g: rng.permutation(8)[: -(-prompt // ctx_tpb)] for g in (0, 1)}
    g_ids = {g: rng.permutation(8)[: -(-prompt // gen_tpb)] for g in (0, 1)}
    kv = logical_kv(model, prompt)
    for c in ctx:
        scatter_logical_kv(c, kv, c_ids, prompt)
    plans = []
    cuts = [0, 20, 33, 50, 70]
    for a, b in zip(cuts, cuts[1:]):
        chunk = chunk_blocks(c_ids, {0: None, 1: 16}, tokens_per_block=ctx_tpb, chunk_start=a, chunk_end=b,
                             prompt_len=prompt)
        for c in ctx:
            plan = plan_write(c.info, chunked.info, chunk.block_ids, g_ids)
            execute_plan(plan)
            plans.append(plan)
    for c in ctx:
        execute_plan(plan_write(c.info, one_shot.info, c_ids, g_ids))
    assert all(int(n.max()) <= 1 for n in count_writes(chunked, plans))
    for a, b in zip(chunked.pools, one_shot.pools):
        np.testing.assert_array_equal(a, b)
