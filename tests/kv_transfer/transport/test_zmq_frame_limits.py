"""The KV control plane's sockets (the listener's ROUTER, the send and request DEALERs) bound the
frames they take (MAXMSGSIZE): a peer announcing a bigger one is disconnected before libzmq buffers
it, and the messenger keeps serving. See hostile_peer.py for how memory is measured."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from hostile_peer import FRAME, MAX_GROWTH, PeakRss, run_peer, start_peer, stop_peer
from pdserve.kv_transfer.control.messages import Cancel, RankInfoReply, RankInfoRequest
from pdserve.kv_transfer.control.messenger import DEFAULT_MAX_MESSAGE_BYTES, Messenger
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.transceiver import TransceiverConfig


def _answering_server() -> Messenger:
    return Messenger(lambda m: RankInfoReply([b"ok"]) if isinstance(m, RankInfoRequest) else None)


def test_default_bound_has_a_wide_margin_and_is_configurable():
    # The tests' largest legitimate message is ~1.2 KB; a 128-rank RankInfoReply with 64 KiB agent
    # descriptors ~8.5 MB; a REQUEST_DATA for a 1M-token prompt at one token per block ~8.4 MB.
    assert 8.5e6 < DEFAULT_MAX_MESSAGE_BYTES < FRAME
    assert TransceiverConfig().max_control_message_bytes == DEFAULT_MAX_MESSAGE_BYTES
    small = Messenger(lambda m: None, max_message_bytes=4096)
    try:
        with pytest.raises(KVTransferError, match="max_control_message_mb"):
            small.send(small.endpoint, RankInfoReply([bytes(8192)]))
        small.send(small.endpoint, Cancel(1, ("g", 0)))
        assert all(link.sock.getsockopt(zmq.MAXMSGSIZE) == 4096 for link in small._dealers.values())
    finally:
        small.close()


def test_router_disconnects_an_oversized_frame_and_keeps_answering():
    server, client = _answering_server(), Messenger(lambda m: None)
    try:
        assert client.request(server.endpoint, RankInfoRequest(("gen", 0)), timeout_s=5) == RankInfoReply([b"ok"])
        with PeakRss() as rss:
            run_peer(f"""
import time, zmq
s = zmq.Context().socket(zmq.DEALER)
s.connect({server.endpoint!r})
s.send(bytes({FRAME}))
time.sleep(1.0)
s.close(linger=0)
""")
        assert client.request(server.endpoint, RankInfoRequest(("gen", 1)), timeout_s=5) == RankInfoReply([b"ok"])
        assert server.alive
        assert rss.growth < MAX_GROWTH, f"the listener buffered the frame: RSS grew by {rss.growth >> 20} MiB"
        assert server.dropped_messages == 0  # never delivered, so never decoded
    finally:
        client.close()
        server.close()


def test_send_dealer_reconnects_after_a_peer_sent_it_an_oversized_frame():
    """libzmq drops the connection for good after a frame over MAXMSGSIZE; later sends must still
    reach the peer (a fresh DEALER), not vanish into the dead one."""
    client = Messenger(lambda m: None, max_message_bytes=4096)
    peer = zmq.Context.instance().socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    dropped = peer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sender = None
    try:
        endpoint = f"tcp://127.0.0.1:{peer.bind_to_random_port('tcp://127.0.0.1')}"
        client.send(endpoint, Cancel(1, ("g", 0)))
        assert peer.poll(5000)
        identity, _ = peer.recv_multipart()
        peer.send_multipart([identity, bytes(8192)])  # over the client's bound
        assert dropped.poll(5000), "the client did not drop the connection"
        got, deadline = [], time.monotonic() + 5

        def keep_sending():
            for n in range(2, 1000):
                client.send(endpoint, Cancel(n, ("g", 0)))
                while peer.poll(50):
                    got.append(peer.recv_multipart()[1])
                if got or time.monotonic() > deadline:
                    return

        sender = threading.Thread(target=keep_sending, daemon=True)
        sender.start()
        sender.join(10)
        assert not sender.is_alive(), "send() blocked on the dropped connection"
        assert got, "nothing sent after the oversized frame reached the peer"
    finally:
        peer.disable_monitor()
        dropped.close()
        peer.close()
        if sender is None or not sender.is_alive():  # else it holds the send lock: leave it to the daemon
            client.close()


def test_request_dealer_refuses_an_oversized_reply():
    proc, endpoint = start_peer(f"""
import sys, time, zmq
s = zmq.Context().socket(zmq.ROUTER)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(f"tcp://127.0.0.1:{{port}}", flush=True)
identity, _ = s.recv_multipart()
s.send_multipart([identity, bytes({FRAME})])
time.sleep(5)
""")
    client = Messenger(lambda m: None)
    try:
        with PeakRss() as rss, pytest.raises(TimeoutError, match=endpoint):
            client.request(endpoint, RankInfoRequest(("gen", 0)), timeout_s=1.5)
        assert rss.growth < MAX_GROWTH, f"the reply was buffered: RSS grew by {rss.growth >> 20} MiB"
    finally:
        client.close()
        stop_peer(proc)
