"""The control-plane wire protocol: typed messages over msgpack, never pickle.

Frame: msgpack map {"v": PROTOCOL_VERSION, "t": MessageType, "b": body}. Every body field is checked
on decode; anything unexpected raises `ProtocolError`, which the messenger logs and drops.

Conversation (generation rank G, context instance C with ranks C0..Cn; C0 is the rendezvous):

    G  -> C0  RANK_INFO_REQUEST                 (once per endpoint, cached)
    C0 -> G   RANK_INFO_REPLY(all ranks of C)
    G  -> Ck  REGISTER_PEER(G's RankInfo)       (once per peer rank)
    G  -> Ck  REQUEST_DATA(request, dst block ids per layer group, token range)   (every Ck)
    Ck => G   one-sided write, whose agent notification is TRANSFER_DONE (data first, then notice);
              a pipelined send is several writes, one per prefill chunk, the last one flagged;
              with checksums on it also carries the sender's block ids and a CRC32 per
              destination block (integrity.py)
    Ck -> G   TRANSFER_ERROR                    (control plane, when Ck cannot serve it)
    Ck -> G   UNKNOWN_REQUEST                   (Ck does not hold the request and never will: it never
                                                 had it, or its send ended; G fails it at once)
    G  -> Ck  CANCEL                            (G gave up; Ck drops work it has not started)

Block ids travel as int64 arrays (-1 = skip) keyed by layer-group id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import ClassVar

import msgpack
import numpy as np

from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.rank_info import RankInfo

PROTOCOL_VERSION = 6  # bumped with any change of a message's fields: decoding refuses another version

PeerKey = tuple[str, int]  # (instance name, rank): never a concatenated string


class ProtocolError(KVTransferError):
    """A control message is malformed, of an unknown type, or of another protocol version."""


class MessageType(enum.IntEnum):
    RANK_INFO_REQUEST = 1
    RANK_INFO_REPLY = 2
    REGISTER_PEER = 3
    REQUEST_DATA = 4
    TRANSFER_DONE = 5
    TRANSFER_ERROR = 6
    CANCEL = 7
    UNKNOWN_REQUEST = 8


_TYPES: dict[MessageType, type["Message"]] = {}


class Message:
    """Base of all messages: subclasses are dataclasses with a TYPE and a checked body."""

    TYPE: ClassVar[MessageType]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _TYPES[cls.TYPE] = cls

    def to_bytes(self) -> bytes:
        return msgpack.packb({"v": PROTOCOL_VERSION, "t": int(self.TYPE), "b": self._body()})

    def _body(self) -> dict:
        return {f.name: _encode(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def _from_body(cls, body: dict) -> "Message":
        expected = {f.name for f in fields(cls)}
        if set(body) != expected:
            raise ProtocolError(
                f"{cls.TYPE.name} body has fields {sorted(body)}, expected {sorted(expected)}"
            )
        return cls(**{name: _DECODERS[cls][name](body[name]) for name in expected})


def decode(data: bytes) -> Message:
    """Parse one frame into its typed message; raises ProtocolError on anything unexpected."""
    try:
        frame = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ProtocolError(f"undecodable control message ({len(data)} bytes): {exc}") from None
    if not isinstance(frame, dict) or set(frame) != {"v", "t", "b"}:
        raise ProtocolError(f"control frame must be a map with keys v, t, b; got {type(frame).__name__}")
    if frame["v"] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"control protocol version {frame['v']!r} != ours {PROTOCOL_VERSION}; run one pdserve version on both sides"
        )
    try:
        cls = _TYPES[MessageType(frame["t"])]
    except (ValueError, KeyError):
        raise ProtocolError(f"unknown control message type {frame['t']!r}") from None
    if not isinstance(frame["b"], dict):
        raise ProtocolError(f"{cls.TYPE.name} body must be a map")
    try:
        return cls._from_body(frame["b"])
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"malformed {cls.TYPE.name} body: {exc}") from None


# -- field codecs ------------------------------------------------------------------------------

def _encode(value):
    if isinstance(value, np.ndarray):
        return value.astype("<i8").tobytes()
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return list(value)
    return value


def _int(v) -> int:
    if type(v) is not int:
        raise ProtocolError(f"expected an integer, got {type(v).__name__}")
    return v


def _str(v) -> str:
    if not isinstance(v, str):
        raise ProtocolError(f"expected a string, got {type(v).__name__}")
    return v


def _bytes(v) -> bytes:
    if not isinstance(v, bytes):
        raise ProtocolError(f"expected bytes, got {type(v).__name__}")
    return v


def _peer(v) -> PeerKey:
    if not isinstance(v, list) or len(v) != 2:
        raise ProtocolError("expected a peer key [instance, rank]")
    return _str(v[0]), _int(v[1])


def _token_range(v) -> tuple[int, int]:
    if not isinstance(v, list) or len(v) != 2:
        raise ProtocolError("expected a token range [begin, end]")
    begin, end = _int(v[0]), _int(v[1])
    if not 0 <= begin <= end:
        raise ProtocolError(f"token range [{begin}, {end}) is not ordered")
    return begin, end


def _block_ids(v) -> dict[int, np.ndarray]:
    if not isinstance(v, dict):
        raise ProtocolError("block ids must be a map layer-group id -> int64 array")
    out = {}
    for group, raw in v.items():
        raw = _bytes(raw)
        if len(raw) % 8:
            raise ProtocolError(f"block ids of layer group {group} are {len(raw)} bytes, not a multiple of 8")
        ids = np.frombuffer(raw, dtype="<i8").astype(np.int64)
        if (ids < -1).any():
            raise ProtocolError(f"block ids of layer group {group} hold values below -1")
        out[_int(group)] = ids
    return out


def _digests(v) -> bytes:
    if len(_bytes(v)) % 4:
        raise ProtocolError(f"digests are {len(v)} bytes, not a multiple of 4")
    return v


def _rank_info(v) -> bytes:
    """RankInfo bytes, parsed once here so that a broken one is refused by the listener (a warning)
    instead of failing later on the executor thread."""
    RankInfo.from_bytes(_bytes(v))
    return v


def _list_of_bytes(v) -> list[bytes]:
    if not isinstance(v, list):
        raise ProtocolError("expected a list of byte strings")
    return [_bytes(x) for x in v]


def _optional_map(v) -> dict | None:
    if v is not None and not isinstance(v, dict):
        raise ProtocolError("expected a map or nil")
    return v


# -- messages ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankInfoRequest(Message):
    TYPE: ClassVar[MessageType] = MessageType.RANK_INFO_REQUEST
    sender: PeerKey


@dataclass(frozen=True)
class RankInfoReply(Message):
    """Every rank of the answering instance, each as RankInfo.to_bytes(), ordered by rank."""

    TYPE: ClassVar[MessageType] = MessageType.RANK_INFO_REPLY
    rank_infos: list[bytes]


@dataclass(frozen=True)
class RegisterPeer(Message):
    TYPE: ClassVar[MessageType] = MessageType.REGISTER_PEER
    rank_info: bytes


@dataclass(frozen=True)
class RequestData(Message):
    """One generation rank asks one context rank for a request's KV.

    num_requesters: how many generation ranks send this request to each context rank (its whole
    instance), so the context side knows when it has served everybody. bounce: the receiver's
    staging offer (see bounce.py) or None for the direct path. checksum: the receiver wants a
    CRC32 per block with every write (integrity.py). canary: this is the first-contact canary
    (canary.py): the context rank fills its own canary blocks with the pattern for tokens
    [0, token_range[1]) and writes them like any request. wait_for_offer: the context instance may
    not hold the request yet (generation_first asks before the prefill ends), so the context rank
    parks it until its offer comes, at most kv_transfer_timeout_ms. Off (context_first: the context
    instance answered before the generation side asks), the context rank must already hold the
    request, and answers UNKNOWN_REQUEST at once when it does not.
    """

    TYPE: ClassVar[MessageType] = MessageType.REQUEST_DATA
    disagg_id: int
    sender: PeerKey
    block_ids: dict[int, np.ndarray] = field(compare=False)
    token_range: tuple[int, int]
    num_requesters: int
    bounce: dict | None = None
    checksum: bool = False
    canary: bool = False
    wait_for_offer: bool = True


@dataclass(frozen=True)
class TransferDone(Message):
    """Sent as the agent notification of the write, so it arrives after the data.

    chunk: index of this write among the sender's writes of the request (0, 1, ...); the one with
    `last` set also tells how many there were. token_range: the exact prompt tokens this write
    completes, (0, 0) when the sender did not say. state: small opaque request state that rides
    with the last write (e.g. the first generated token), b"" for none. src_block_ids and digests:
    empty unless checksums are on; then the sender's block ids of this write (so the receiver can
    re-plan it) and little-endian uint32 CRC32s per destination block in plan order.
    """

    TYPE: ClassVar[MessageType] = MessageType.TRANSFER_DONE
    disagg_id: int
    sender: PeerKey
    num_bytes: int
    bounced: bool = False
    chunk: int = 0
    last: bool = True
    token_range: tuple[int, int] = (0, 0)
    state: bytes = b""
    src_block_ids: dict[int, np.ndarray] = field(default_factory=dict, compare=False)
    digests: bytes = b""


@dataclass(frozen=True)
class TransferError(Message):
    TYPE: ClassVar[MessageType] = MessageType.TRANSFER_ERROR
    disagg_id: int
    sender: PeerKey
    reason: str


@dataclass(frozen=True)
class UnknownRequest(Message):
    """The context rank holds no such request and will not get one: it never had it (or not within
    kv_transfer_timeout_ms), or its send already ended (pulled, released, timed out). The receiver
    fails the request at once; its client is told the KV does not exist."""

    TYPE: ClassVar[MessageType] = MessageType.UNKNOWN_REQUEST
    disagg_id: int
    sender: PeerKey
    reason: str


@dataclass(frozen=True)
class Cancel(Message):
    TYPE: ClassVar[MessageType] = MessageType.CANCEL
    disagg_id: int
    sender: PeerKey


def _bool(v) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(f"expected a bool, got {type(v).__name__}")
    return v


_DECODERS = {
    RankInfoRequest: {"sender": _peer},
    RankInfoReply: {"rank_infos": _list_of_bytes},
    RegisterPeer: {"rank_info": _rank_info},
    RequestData: {"disagg_id": _int, "sender": _peer, "block_ids": _block_ids, "token_range": _token_range,
                  "num_requesters": _int, "bounce": _optional_map, "checksum": _bool,
                  "canary": _bool, "wait_for_offer": _bool},
    TransferDone: {"disagg_id": _int, "sender": _peer, "num_bytes": _int, "bounced": _bool, "chunk": _int,
                   "last": _bool, "token_range": _token_range, "state": _bytes, "src_block_ids": _block_ids,
                   "digests": _digests},
    TransferError: {"disagg_id": _int, "sender": _peer, "reason": _str},
    UnknownRequest: {"disagg_id": _int, "sender": _peer, "reason": _str},
    Cancel: {"disagg_id": _int, "sender": _peer},
}
