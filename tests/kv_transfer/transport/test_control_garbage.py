"""Garbage that decodes as a control message but carries a broken payload is refused by the listener
with a warning, not a traceback on the executor thread."""

from __future__ import annotations

import logging
import time

import zmq

from kvt_instance import Topology
from pdserve.kv_transfer.control.messages import RegisterPeer


def test_register_peer_with_garbage_rank_info_is_a_warning_without_traceback(pair, caplog):
    (ctx,), _ = pair(Topology("ctx"), Topology("gen"))
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.SNDTIMEO, 5000)  # a send with no pipe to queue for would otherwise wait forever
    try:
        raw.connect(ctx.tx.endpoint)
        with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer"):
            for payload in (b"not msgpack \xc1", b"\x92\x01\x02"):
                raw.send(RegisterPeer(payload).to_bytes())
            deadline = time.monotonic() + 5
            while ctx.tx.messenger.dropped_messages < 2 and time.monotonic() < deadline:
                ctx.tx.check_context_transfer_status()  # drains whatever the listener queued
                time.sleep(0.01)
            ctx.tx.check_context_transfer_status()
        rejected = [r for r in caplog.records if "REGISTER_PEER" in r.getMessage()]
        assert len(rejected) == 2 and all(r.levelno == logging.WARNING for r in rejected)
        assert not [r for r in caplog.records if r.exc_info], "a garbage message logged a traceback"
        assert ctx.tx.messenger.alive and not ctx.tx.gen_peers
    finally:
        raw.close()
