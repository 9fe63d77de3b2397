"""One rank's end of the control plane, as the transceiver uses it.

    listener thread:  RANK_INFO_REQUEST ──> answered at once from immutable state (our instance)
                      anything else     ──> queued, and the executor woken
    executor thread:  drain() ──> each queued message to the side it is for
                                    REGISTER_PEER, REQUEST_DATA, CANCEL ──> the sender
                                    TRANSFER_ERROR, UNKNOWN_REQUEST    ──> the receiver
                                  each agent notification (a TRANSFER_DONE) ──> the receiver

It also keeps the context instances this rank asked for KV: their RankInfos, fetched once per
endpoint (`fetch_instance`, safe from any thread) and cached (`add_instance`), and which of their
ranks we registered with.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Protocol, Sequence

from pdserve.kv_transfer.control.messages import (
    Cancel,
    Message,
    PeerKey,
    ProtocolError,
    RankInfoReply,
    RankInfoRequest,
    RegisterPeer,
    RequestData,
    TransferDone,
    TransferError,
    UnknownRequest,
    decode,
)
from pdserve.kv_transfer.control.messenger import Messenger
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.rank_info import RankInfo
from pdserve.kv_transfer.transceiver.base import Local

logger = logging.getLogger(__name__)


class SendSide(Protocol):
    """What the control plane hands the context side (sender.py)."""

    def add_peer(self, info: RankInfo) -> None: ...
    def on_request_data(self, message: RequestData) -> None: ...
    def on_cancel(self, message: Cancel) -> None: ...


class ReceiveSide(Protocol):
    """What the control plane hands the generation side (receiver.py)."""

    def on_written(self, done: TransferDone) -> None: ...
    def on_error(self, message: TransferError) -> None: ...
    def on_unknown(self, message: UnknownRequest) -> None: ...


class ControlPlane:
    def __init__(self, local: Local, host: str) -> None:
        self._local = local
        self.events: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.wake = threading.Event()  # set by the listener when it enqueues a message
        self.notify: Callable[[], None] | None = None  # also called then (on the listener thread)
        self._instance_reply: RankInfoReply | None = None
        self._ctx_instances: dict[str, tuple[RankInfo, ...]] = {}  # ctx endpoint -> its ranks (cached)
        self._registered_with: set[PeerKey] = set()
        self._sender: SendSide | None = None
        self._receiver: ReceiveSide | None = None
        self.messenger = Messenger(self._on_message, host=host, name="kv",
                                   max_message_bytes=local.config.max_control_message_bytes,
                                   cluster_token=local.config.cluster_token,
                                   heartbeat_ms=local.config.peer_lost_ms)

    def connect(self, sender: SendSide, receiver: ReceiveSide) -> None:
        """The two sides drain() hands messages to."""
        self._sender, self._receiver = sender, receiver

    def publish(self, ranks: Sequence[RankInfo]) -> None:
        """Answer RankInfo requests with our instance's ranks from now on."""
        self._instance_reply = RankInfoReply([r.to_bytes() for r in ranks])

    def send(self, endpoint: str, message: Message) -> None:
        self.messenger.send(endpoint, message)

    def unreachable_for(self, endpoint: str) -> float:
        """Seconds our link to `endpoint` has been without a connection (Messenger.unreachable_for)."""
        return self.messenger.unreachable_for(endpoint)

    def close(self) -> None:
        self.messenger.close()

    # -- listener thread ----------------------------------------------------------------------
    def _on_message(self, message: Message) -> Message | None:
        if isinstance(message, RankInfoRequest):
            return self._instance_reply  # None before start(): the asker times out with a clear error
        self.events.put(message)
        self.wake.set()
        if self.notify is not None:
            self.notify()
        return None

    # -- executor thread ----------------------------------------------------------------------
    def drain(self) -> int:
        """Apply queued control messages and agent notifications to the session tables; how many."""
        applied = 0
        while not self.events.empty():  # this thread is the queue's only reader: the get never waits
            applied += 1
            message = self.events.get_nowait()
            try:
                self._apply(message)
            except Exception:
                logger.exception("%s: failed to apply %s", self._local.key, message.TYPE.name)
        for sender, payload in self._local.agent.get_notifications():
            applied += 1
            try:
                done = decode(payload)
            except ProtocolError as exc:
                logger.warning("dropped a malformed transfer notification from %s: %s", sender, exc)
                continue
            if not isinstance(done, TransferDone):
                logger.warning("dropped a %s sent as a transfer notification by %s", done.TYPE.name, sender)
                continue
            self._receiver.on_written(done)
        return applied

    def _apply(self, message: Message) -> None:
        if isinstance(message, RegisterPeer):
            self._sender.add_peer(RankInfo.from_bytes(message.rank_info))
        elif isinstance(message, RequestData):
            self._sender.on_request_data(message)
        elif isinstance(message, Cancel):
            self._sender.on_cancel(message)
        elif isinstance(message, TransferError):
            self._receiver.on_error(message)
        elif isinstance(message, UnknownRequest):
            self._receiver.on_unknown(message)
        else:
            logger.warning("%s: unexpected control message %s", self._local.key, message.TYPE.name)

    # -- context instances (generation side) --------------------------------------------------
    def fetch_instance(self, endpoint: str) -> list[bytes]:
        """The RankInfos (as bytes) of the context instance at `endpoint`, asked over the network."""
        own = self._local.require_started()
        reply = self.messenger.request(endpoint, RankInfoRequest(own.key), self._local.config.rank_info_timeout_s)
        if not isinstance(reply, RankInfoReply) or not reply.rank_infos:
            raise KVTransferError(f"context endpoint {endpoint} answered {reply.TYPE.name}, not its RankInfos")
        return list(reply.rank_infos)

    def add_instance(self, endpoint: str, rank_infos: Sequence[bytes]) -> None:
        if endpoint not in self._ctx_instances:
            self._ctx_instances[endpoint] = tuple(RankInfo.from_bytes(b) for b in rank_infos)

    def forget_instance(self, endpoint: str) -> None:
        for info in self._ctx_instances.pop(endpoint, ()):
            self._registered_with.discard(info.key)

    def ctx_ranks(self, endpoint: str) -> tuple[RankInfo, ...]:
        """The context instance's ranks (fetched on first use), each told our RankInfo once."""
        cached = self._ctx_instances.get(endpoint)
        if cached is None:
            self.add_instance(endpoint, self.fetch_instance(endpoint))
            cached = self._ctx_instances[endpoint]
        for ctx in cached:
            if ctx.key not in self._registered_with:
                self.messenger.send(ctx.control_endpoint, RegisterPeer(self._local.own.to_bytes()))
                self._registered_with.add(ctx.key)
        return cached
