"""Control plane: typed msgpack messages and the ZeroMQ messenger."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from pdserve.kv_transfer.control.messages import (
    PROTOCOL_VERSION,
    Cancel,
    MessageType,
    ProtocolError,
    RankInfoReply,
    RankInfoRequest,
    RequestData,
    TransferDone,
    TransferError,
    decode,
)
from pdserve.kv_transfer.control.messenger import Messenger


def test_round_trip_every_message_type():
    ids = {0: np.array([3, -1, 7], np.int64), 2: np.array([], np.int64)}
    req = RequestData(11, ("gen", 1), ids, (0, 40), 2, {"offset": 4096})
    back = decode(req.to_bytes())
    assert isinstance(back, RequestData) and back == req
    assert set(back.block_ids) == {0, 2} and back.block_ids[0].tolist() == [3, -1, 7]
    for msg in (RankInfoRequest(("gen", 0)), RankInfoReply([b"a", b"b"]), TransferDone(5, ("ctx", 3), 100, False),
                TransferDone(5, ("ctx", 3), 64, False, 2, True, (16, 23), b"\x01state"),
                TransferError(5, ("ctx", 3), "boom"), Cancel(5, ("gen", 0))):
        assert decode(msg.to_bytes()) == msg
    assert {t.name for t in MessageType} >= {"RANK_INFO_REQUEST", "REQUEST_DATA", "TRANSFER_DONE", "CANCEL"}


def test_checksum_fields_round_trip_and_are_checked():
    req = decode(RequestData(1, ("gen", 0), {0: np.array([1], np.int64)}, (0, 4), 1, None, True).to_bytes())
    assert req.checksum is True and req.canary is False
    canary = decode(RequestData(1 << 63, ("gen", 0), {0: np.array([1], np.int64)}, (0, 4), 1, canary=True).to_bytes())
    assert canary.canary is True and canary.disagg_id == 1 << 63
    done = TransferDone(5, ("ctx", 0), 64, False, 0, True, (0, 4), b"", {0: np.array([2, -1], np.int64)},
                        b"\x01\x02\x03\x04")
    back = decode(done.to_bytes())
    assert back == done and back.src_block_ids[0].tolist() == [2, -1] and back.digests == b"\x01\x02\x03\x04"
    body = msgpack.unpackb(done.to_bytes(), strict_map_key=False)["b"] | {"digests": b"\x01\x02\x03"}
    with pytest.raises(ProtocolError, match="not a multiple of 4"):
        decode(_frame(int(MessageType.TRANSFER_DONE), body))


def _frame(t, body, v=PROTOCOL_VERSION):
    return msgpack.packb({"v": v, "t": t, "b": body})


@pytest.mark.parametrize(
    "data, match",
    [
        (b"\xc1\xff", "undecodable"),
        (msgpack.packb([1, 2]), "map with keys"),
        (_frame(99, {}), "unknown control message type 99"),
        (_frame(int(MessageType.CANCEL), {"disagg_id": 1, "sender": ["g", 0]}, v=7), "version 7"),
        (_frame(int(MessageType.CANCEL), {"disagg_id": 1}), "expected"),
        (_frame(int(MessageType.CANCEL), {"disagg_id": "1", "sender": ["g", 0]}), "integer"),
        (_frame(int(MessageType.REQUEST_DATA), {"disagg_id": 1, "sender": ["g", 0], "block_ids": {0: b"abc"},
                                                "token_range": [0, 1], "num_requesters": 1, "bounce": None,
                                                "checksum": False, "canary": False, "wait_for_offer": True}),
         "multiple of 8"),
        (_frame(int(MessageType.REQUEST_DATA), {"disagg_id": 1, "sender": ["g", 0], "block_ids": {},
                                                "token_range": [5, 1], "num_requesters": 1, "bounce": None,
                                                "checksum": False, "canary": False, "wait_for_offer": True}),
         "not ordered"),
        (msgpack.packb({"v": 1, "t": 7, "b": {"disagg_id": 1, "sender": ["g", 0]}, "x": 1}), "map with keys"),
    ],
)
def test_malformed_messages_raise_typed_error(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode(data)


def test_messenger_survives_malformed_messages_and_handler_errors():
    seen: queue.Queue = queue.Queue()

    def handler(msg):
        if isinstance(msg, Cancel) and msg.disagg_id == 666:
            raise RuntimeError("handler bug")
        seen.put(msg)
        if isinstance(msg, RankInfoRequest):
            return RankInfoReply([b"info-" + msg.sender[0].encode()])
        return None

    server = Messenger(handler)
    client = Messenger(lambda m: None)
    try:
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.SNDTIMEO, 5000)  # a send with no pipe to queue for would otherwise wait forever
        raw.connect(server.endpoint)
        raw.send(b"garbage")
        raw.send(_frame(42, {}))
        raw.send_multipart([b"a", b"b"])
        client.send(server.endpoint, Cancel(666, ("g", 0)))
        client.send(server.endpoint, Cancel(1, ("g", 0)))
        assert seen.get(timeout=5) == Cancel(1, ("g", 0))
        reply = client.request(server.endpoint, RankInfoRequest(("gen", 3)), timeout_s=5)
        assert reply == RankInfoReply([b"info-gen"])
        deadline = time.monotonic() + 5  # the raw socket's frames travel on another connection
        while server.dropped_messages < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.alive and server.dropped_messages == 4
        raw.close()
    finally:
        client.close()
        server.close()


def test_request_times_out_with_endpoint_in_message():
    silent = Messenger(lambda m: None)
    client = Messenger(lambda m: None)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=silent.endpoint):
            client.request(silent.endpoint, RankInfoRequest(("g", 0)), timeout_s=0.2)
        assert time.monotonic() - t0 < 2
    finally:
        client.close()
        silent.close()


def test_handler_runs_on_listener_thread_not_caller():
    threads = []
    done = threading.Event()

    def handler(msg):
        threads.append(threading.current_thread().name)
        done.set()

    server, client = Messenger(handler, name="srv"), Messenger(lambda m: None)
    try:
        client.send(server.endpoint, Cancel(1, ("g", 0)))
        assert done.wait(5) and threads == ["srv-control"]
    finally:
        client.close(), server.close()


_PEER = """
import sys, time
from pdserve.kv_transfer.control.messenger import Messenger
m = Messenger(lambda msg: None, name="frozen-peer")
print(m.endpoint, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("heartbeat_ms", [500, None])
def test_a_frozen_peer_shows_as_unreachable_only_with_heartbeats(heartbeat_ms):
    """A peer process stopped (SIGSTOP: a frozen process or host) keeps its TCP connection up in the
    kernel's eyes. With heartbeats the link drops and never completes a handshake again, so
    `unreachable_for` grows and the receiver fails the transfers waiting on it after peer_lost_ms;
    without them it reads connected for ever."""
    peer = subprocess.Popen([sys.executable, "-c", _PEER], stdout=subprocess.PIPE, text=True)
    m = Messenger(lambda msg: None, heartbeat_ms=heartbeat_ms)
    try:
        endpoint = peer.stdout.readline().strip()
        m.send(endpoint, Cancel(1, ("gen", 0)))
        deadline = time.monotonic() + 10
        while m.unreachable_for(endpoint) > 0:  # 0 only once a handshake succeeded
            assert time.monotonic() < deadline, "never connected to the live peer"
            time.sleep(0.01)
        os.kill(peer.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        m.send(endpoint, Cancel(2, ("gen", 0)))  # the generation side asks the frozen peer for something
        seen = 0.0
        while time.monotonic() - stopped < 4.0 and seen <= 0.5:
            seen = m.unreachable_for(endpoint)
            time.sleep(0.05)
        if heartbeat_ms is None:
            assert seen == 0.0, f"without heartbeats the link dropped after {seen:.1f} s"
        else:
            assert seen > 0.5, "with heartbeats the frozen peer still reads as connected after 4 s"
            print(f"unreachable for > 0.5 s at {time.monotonic() - stopped:.2f} s after the freeze")
    finally:
        m.close()
        peer.kill()  # SIGKILL ends a stopped process too
        peer.wait(timeout=10)
