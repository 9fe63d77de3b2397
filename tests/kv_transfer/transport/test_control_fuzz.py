"""Hypothesis fuzz of the control-plane codec: whatever bytes or msgpack a peer sends, `decode` returns
a typed message or raises ProtocolError, never anything else (which would be a traceback on the
listener), and every message survives its own round trip."""

from __future__ import annotations

import msgpack
import pytest
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer.control.messages import (
    PROTOCOL_VERSION,
    Cancel,
    Message,
    MessageType,
    ProtocolError,
    RequestData,
    TransferDone,
    TransferError,
    decode,
)

FUZZ = settings(max_examples=200, deadline=None)
pytestmark = pytest.mark.faults

# Any msgpack value: what a hostile peer can pack.
packable = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8) | st.integers(0, 9), inner,
                                                                  max_size=5),
    max_leaves=25)
ints = st.integers(-(2**63), 2**63 - 1)
peers = st.tuples(st.text(max_size=12), st.integers(0, 4096))


def _decodes_or_refuses(data: bytes) -> None:
    try:
        message = decode(data)
    except ProtocolError:
        return
    assert isinstance(message, Message)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data):
    _decodes_or_refuses(data)


@FUZZ
@given(st.sampled_from(list(MessageType)), packable)
def test_a_right_frame_with_any_body(kind, body):
    _decodes_or_refuses(msgpack.packb({"v": PROTOCOL_VERSION, "t": int(kind), "b": body}))


@FUZZ
@given(st.sampled_from(list(MessageType)),
       st.dictionaries(st.sampled_from(["disagg_id", "sender", "block_ids", "token_range", "num_requesters",
                                        "bounce", "num_bytes", "bounced", "chunk", "last", "state", "reason",
                                        "rank_info", "rank_infos"]), packable, max_size=8))
def test_known_field_names_with_any_values(kind, body):
    _decodes_or_refuses(msgpack.packb({"v": PROTOCOL_VERSION, "t": int(kind), "b": body}))


@FUZZ
@given(packable)
def test_any_frame(frame):
    _decodes_or_refuses(msgpack.packb(frame))


@FUZZ
@given(ints, peers, st.lists(st.integers(-1, 2**40), max_size=64), st.integers(0, 2**20), st.integers(0, 2**20),
       st.integers(1, 64))
def test_request_data_round_trip(rid, sender, ids, a, b, n):
    lo, hi = sorted((a, b))
    sent = RequestData(rid, sender, {0: np.asarray(ids, dtype=np.int64)}, (lo, hi), n)
    got = decode(sent.to_bytes())
    assert got == sent and np.array_equal(got.block_ids[0], sent.block_ids[0])


@FUZZ
@given(ints, peers, st.integers(0, 2**62), st.booleans(), st.integers(0, 1000), st.booleans(), st.binary(max_size=64),
       st.text(max_size=40))
def test_done_error_and_cancel_round_trip(rid, sender, nbytes, bounced, chunk, last, state, reason):
    for sent in (TransferDone(rid, sender, nbytes, bounced, chunk, last, (0, 0), state),
                 TransferError(rid, sender, reason), Cancel(rid, sender)):
        assert decode(sent.to_bytes()) == sent
