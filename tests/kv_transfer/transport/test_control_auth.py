"""cluster_token on the KV control plane: CURVE with a keypair derived from the token, the listener's
ZAP handler accepting only that key. Peers without the token are refused before any of their
messages reaches the handler, the listener says so in its log, and legitimate peers are unaffected."""

from __future__ import annotations

import logging
import queue
import time

import pytest
import zmq

from kvt_instance import Topology, build_instance, ctx_block_ids, fill, gen_block_ids, mismatches, pump_until, shutdown
from pdserve.kv_transfer.control.messages import Cancel, RankInfoReply, RankInfoRequest
from pdserve.kv_transfer.control.messenger import CurveKeys, Messenger
from pdserve.testing.wait import wait_until

TOKEN = "s3cret-cluster-token"


_RAW_TIMEOUT_MS = 1000


def _raw_dealer(endpoint: str, keys: tuple[bytes, bytes] | None = None, server_key: bytes | None = None,
                connect: bool = True):
    """A DEALER whose send and recv give up after _RAW_TIMEOUT_MS: once the listener refuses its
    handshake, libzmq drops its only pipe and a plain send would wait for a peer forever."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, _RAW_TIMEOUT_MS)
    sock.setsockopt(zmq.RCVTIMEO, _RAW_TIMEOUT_MS)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_serverkey = server_key
    if connect:
        sock.connect(endpoint)
    return sock


def _raw_send(sock: zmq.Socket, data: bytes) -> None:
    """Send as a stranger would; zmq.Again means the refusal came first and dropped the pipe."""
    try:
        sock.send(data)
    except zmq.Again:
        pass


def test_keys_are_derived_from_the_token_and_curve_is_available():
    assert zmq.has("curve")
    a, b, other = CurveKeys.from_token(TOKEN), CurveKeys.from_token(TOKEN), CurveKeys.from_token(TOKEN + "x")
    assert a == b and a.public != other.public and len(a.public) == len(a.secret) == 40
    assert zmq.curve_public(a.secret) == a.public and TOKEN not in repr(a) and a.secret.decode() not in repr(a)


def test_peers_without_the_token_are_refused_and_logged(caplog):
    seen: queue.Queue = queue.Queue()

    def handler(msg):
        seen.put(msg)
        return RankInfoReply([b"info"]) if isinstance(msg, RankInfoRequest) else None

    server = Messenger(handler, cluster_token=TOKEN)
    legit = Messenger(lambda m: None, cluster_token=TOKEN)
    wrong = Messenger(lambda m: None, cluster_token="another-token")
    none = Messenger(lambda m: None)
    keys = CurveKeys.from_token(TOKEN)
    raws = []
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer.control.messenger"):
            legit.send(server.endpoint, Cancel(1, ("legit", 0)))
            assert seen.get(timeout=5) == Cancel(1, ("legit", 0))
            # Each kind of stranger: another token, no token, a raw NULL socket, and a raw CURVE client
            # that knows the server's public key but not the token (only the ZAP handler stops it).
            strangers = [
                lambda n: wrong.send(server.endpoint, Cancel(n, ("wrong", 0))),
                lambda n: none.send(server.endpoint, Cancel(n, ("none", 0))),
                lambda n: raws.append(_raw_dealer(server.endpoint)) or _raw_send(raws[-1], Cancel(n, ("raw", 0)).to_bytes()),
                lambda n: raws.append(_raw_dealer(server.endpoint, zmq.curve_keypair(), keys.public))
                or _raw_send(raws[-1], Cancel(n, ("zap", 0)).to_bytes()),
            ]
            for n, stranger in enumerate(strangers, start=2):
                before = server.auth_failures
                stranger(n)
                assert wait_until(lambda before=before: server.auth_failures > before), f"stranger {n} was not refused"
            for client in (wrong, none):
                with pytest.raises(ConnectionRefusedError, match="cluster_token"):
                    client.request(server.endpoint, RankInfoRequest(("x", 0)), timeout_s=5)
            reply = legit.request(server.endpoint, RankInfoRequest(("legit", 0)), timeout_s=5)
            assert reply == RankInfoReply([b"info"])
            assert seen.get(timeout=5) == RankInfoRequest(("legit", 0))
            legit.send(server.endpoint, Cancel(99, ("legit", 0)))
            assert seen.get(timeout=5) == Cancel(99, ("legit", 0))
            time.sleep(0.3)  # strangers keep reconnecting meanwhile: still nothing of theirs arrives
        assert seen.empty(), f"a stranger's message was delivered: {seen.get()}"
        refused = [r for r in caplog.records if "a peer failed authentication" in r.getMessage()]
        assert refused and all(r.levelno == logging.WARNING and not r.exc_info for r in refused)
        assert len(refused) < server.auth_failures  # reconnecting strangers do not flood the log
        assert server.alive and server.dropped_messages == 0
    finally:
        for sock in raws:
            sock.close()
        for m in (legit, wrong, none, server):
            m.close()


@pytest.mark.timeout(30)
def test_a_raw_send_after_the_listener_refused_the_handshake_returns():
    """The refusal drops the stranger's pipe (soon after the monitor reports it); a send then has no
    peer to queue for. With the test's send timeout it gives up; without one it waits forever, and
    only the per-test timeout ends it."""
    server = Messenger(lambda m: None, cluster_token=TOKEN)
    sock = _raw_dealer(server.endpoint, zmq.curve_keypair(), CurveKeys.from_token(TOKEN).public, connect=False)
    refused = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(server.endpoint)
        assert refused.poll(5000), "the listener did not refuse the stranger's key"
        gave_up = False
        for n in range(20):
            t0 = time.monotonic()
            try:
                sock.send(Cancel(n, ("zap", 0)).to_bytes())
            except zmq.Again:
                gave_up = True
            assert time.monotonic() - t0 < 3 * _RAW_TIMEOUT_MS / 1000
            if gave_up:
                break
            time.sleep(0.05)
        assert gave_up, "the refused socket kept queueing: its pipe was never dropped"
        assert server.alive and server.auth_failures >= 1
    finally:
        sock.disable_monitor()
        refused.close()
        sock.close()
        server.close()


def test_a_token_on_one_side_only_fails_fast_naming_the_key():
    """The tokenless listener logs the mismatch only when it reads the peer's greeting before the peer
    hangs up, so only the asking side's error is checked here."""
    server, client = Messenger(lambda m: RankInfoReply([b"x"])), Messenger(lambda m: None, cluster_token=TOKEN)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionRefusedError, match="handshake .* failed.*cache_transceiver_config.cluster_token"):
            client.request(server.endpoint, RankInfoRequest(("g", 0)), timeout_s=5)
        assert time.monotonic() - t0 < 2
    finally:
        client.close()
        server.close()


def test_transfer_with_the_same_token_on_both_instances():
    ctx_topo, gen_topo = Topology("ctx"), Topology("gen", tp=2)
    ctx = build_instance(ctx_topo, "fake", cluster_token=TOKEN)
    gen = build_instance(gen_topo, "fake", cluster_token=TOKEN)
    stranger = build_instance(Topology("stranger"), "fake")
    try:
        ids_c, ids_g = ctx_block_ids(ctx_topo, 12), gen_block_ids(gen_topo, 12)
        fill(ctx[0], ids_c)
        for r in gen:
            r.tx.request_and_receive_async(1, ctx[0].tx.endpoint, {0: ids_g})
        ctx[0].tx.respond_and_send_async(1, {0: ids_c})
        res = pump_until(gen, "gen", 1, 10, also=ctx)
        assert all(done == [1] for done, _ in res.values())
        assert all(mismatches(r, ids_g, 12) == 0 for r in gen)
        with pytest.raises(ConnectionRefusedError, match="cluster_token"):
            stranger[0].tx.fetch_instance(ctx[0].tx.endpoint)
        assert wait_until(lambda: ctx[0].tx.messenger.auth_failures > 0)
        assert all(r.tx.messenger.auth_failures == 0 for r in gen)
    finally:
        shutdown(ctx + gen + stranger)
