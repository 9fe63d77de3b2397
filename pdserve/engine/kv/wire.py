"""The rank wire of the KV exchange: rank 0's commands to every rank, and each rank's report back.

Rank 0 decides what moves and puts the step's commands in its `StepSpec` (one broadcast per step);
every rank applies them in order (`KVConnector.apply`) and sends rank 0 a `RankReport`.

    SendKV      context side: offer a request's KV, or one prefill chunk of it (blocks outside the
                chunk are -1; see kv_transfer/chunking.py); `state` rides with the last piece
    ReceiveKV   generation side: pull it into block_ids from the context instance's ranks
    CancelKV    stop; confirmed once no write can land
    ForgetPeer  drop a context instance's cached RankInfos (it may have restarted)

`FirstToken` is the one form of the context instance's first generated token (and its logprob
entry) on its way to the generation instance: in `SendKV.state`, riding with the KV's last write
(generation_first), or base64 in `disaggregated_params.opaque_state`, through the orchestrator.

A command's wire form is a msgpack-friendly map {"v": WIRE_VERSION, "t": CommandKind, "b": fields},
nested inside the step spec's msgpack; a report is {"v": WIRE_VERSION, "b": fields}. Decoding checks
the version, the kind and the field names and raises `KVWireError` on anything else. `disagg_id`
is the orchestrator's integer id of a disaggregated request (the engine's own request ids are strings).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Callable, ClassVar, Union

import msgpack

WIRE_VERSION = 4  # bumped with any change of a command's or a report's fields


class CommandKind(enum.IntEnum):
    SEND = 1
    RECEIVE = 2
    CANCEL = 3
    FORGET = 4


class KVWireError(ValueError):
    """A rank-wire command or report is malformed, of an unknown kind, or of another wire version."""


def _ints(v) -> tuple[int, ...]:
    # msgpack decoded them as ints already; np.asarray(..., dtype=np.int64) in the connector checks them
    if not isinstance(v, (list, tuple)):
        raise TypeError(f"expected a list of ints, got {type(v).__name__}")
    return tuple(v)


def _blobs(v) -> tuple[bytes, ...]:
    return tuple(bytes(x) for x in v)


@dataclass(frozen=True)
class SendKV:
    KIND: ClassVar[CommandKind] = CommandKind.SEND
    disagg_id: int
    block_ids: tuple[int, ...]  # the request's blocks, -1 where this piece sends none
    token_start: int
    token_end: int
    last: bool
    state: bytes  # the first token when it rides with the KV (generation_first), else b""
    state_slot: int = -1  # hybrid models: the recurrent-state slot, sent with the last piece only (else -1)


@dataclass(frozen=True)
class ReceiveKV:
    KIND: ClassVar[CommandKind] = CommandKind.RECEIVE
    disagg_id: int
    ctx_endpoint: str
    block_ids: tuple[int, ...]
    ctx_dp_rank: int
    ctx_rank_infos: tuple[bytes, ...]  # fetched once by rank 0 off the step loop (PeerDirectory)
    timeout_ms: int  # what is left of the request's kv_transfer_timeout_ms
    wait_for_offer: bool  # generation_first: the context side may get the request after our ask
    state_slot: int = -1  # hybrid models: the recurrent-state slot the state lands in


@dataclass(frozen=True)
class CancelKV:
    KIND: ClassVar[CommandKind] = CommandKind.CANCEL
    disagg_id: int


@dataclass(frozen=True)
class ForgetPeer:
    KIND: ClassVar[CommandKind] = CommandKind.FORGET
    ctx_endpoint: str


KVCommand = Union[SendKV, ReceiveKV, CancelKV, ForgetPeer]

_DECODERS: dict[type, dict[str, Callable]] = {
    SendKV: {"disagg_id": int, "block_ids": _ints, "token_start": int, "token_end": int, "last": bool,
             "state": bytes, "state_slot": int},
    ReceiveKV: {"disagg_id": int, "ctx_endpoint": str, "block_ids": _ints, "ctx_dp_rank": int,
                "ctx_rank_infos": _blobs, "timeout_ms": int, "wait_for_offer": bool, "state_slot": int},
    CancelKV: {"disagg_id": int},
    ForgetPeer: {"ctx_endpoint": str},
}
_BY_KIND: dict[int, type] = {cls.KIND: cls for cls in _DECODERS}
_FIELDS: dict[type, tuple[str, ...]] = {cls: tuple(f.name for f in fields(cls)) for cls in _DECODERS}


def command_to_wire(cmd: KVCommand) -> dict:
    return {"v": WIRE_VERSION, "t": int(cmd.KIND), "b": {name: getattr(cmd, name) for name in _FIELDS[type(cmd)]}}


def command_from_wire(w) -> KVCommand:
    """Parse one command's wire form; raises KVWireError on anything unexpected."""
    _check_frame(w, {"v", "t", "b"}, "KV command")
    cls = _BY_KIND.get(w["t"])
    if cls is None:
        raise KVWireError(f"unknown KV command kind {w['t']!r}")
    return cls(**_decode_body(cls.KIND.name, w["b"], _DECODERS[cls]))


@dataclass
class RankReport:
    """What one rank finished this step."""

    done: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    cancelled: list[int] = field(default_factory=list)
    tokens: dict[int, int] = field(default_factory=dict)  # received: prompt tokens the sender delivered
    states: dict[int, bytes] = field(default_factory=dict)  # received: state that rode with the KV
    unknown: list[int] = field(default_factory=list)  # failed receives: the context side holds no such request

    # maps travel as [key, value] pairs: msgpack's default decoder refuses int map keys
    _DECODERS: ClassVar[dict[str, Callable]] = {
        "done": lambda v: [int(x) for x in v],
        "failed": lambda v: {int(k): str(x) for k, x in v},
        "cancelled": lambda v: [int(x) for x in v],
        "tokens": lambda v: {int(k): int(x) for k, x in v},
        "states": lambda v: {int(k): bytes(x) for k, x in v},
        "unknown": lambda v: [int(x) for x in v],
    }

    def to_wire(self) -> dict:
        return {"v": WIRE_VERSION, "b": {"done": self.done, "failed": list(self.failed.items()),
                                         "cancelled": self.cancelled, "tokens": list(self.tokens.items()),
                                         "states": list(self.states.items()), "unknown": self.unknown}}

    @classmethod
    def from_wire(cls, w) -> "RankReport":
        _check_frame(w, {"v", "b"}, "KV rank report")
        return cls(**_decode_body("rank report", w["b"], cls._DECODERS))


def _check_frame(w, keys: set[str], what: str) -> None:
    if not isinstance(w, dict) or w.keys() != keys:
        raise KVWireError(f"{what} must be a map with keys {sorted(keys)}; got {w!r:.200}")
    if w["v"] != WIRE_VERSION:
        raise KVWireError(f"{what} has wire version {w['v']!r}, this rank speaks {WIRE_VERSION}: every rank of an "
                          "instance, and both instances of a transfer, must run the same pdserve version")


def _decode_body(name: str, body, decoders: dict[str, Callable]) -> dict:
    if not isinstance(body, dict) or body.keys() != decoders.keys():
        got = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise KVWireError(f"{name} has fields {got}, expected {sorted(decoders)}")
    try:
        return {k: decode(body[k]) for k, decode in decoders.items()}
    except (TypeError, ValueError) as e:
        raise KVWireError(f"malformed {name}: {e}") from None


def _logprob_entries(v) -> tuple[dict, ...]:
    """[{"token_id", "logprob", "top": [[id, lp], ...]}, ...] as the engine keeps them (top as tuples)."""
    if not isinstance(v, (list, tuple)):
        raise TypeError(f"expected a list of logprob entries, got {type(v).__name__}")
    try:
        return tuple({"token_id": int(e["token_id"]), "logprob": float(e["logprob"]),
                      "top": [(int(t), float(lp)) for t, lp in e["top"]]} for e in v)
    except (KeyError, TypeError) as e:
        raise TypeError(f"a logprob entry is not {{token_id, logprob, top}}: {e!r}") from None


@dataclass(frozen=True)
class FirstToken:
    """The context instance's first generated token and, when the request asked for logprobs, its
    logprob entry."""

    token: int
    logprobs: tuple[dict, ...] = ()

    _DECODERS: ClassVar[dict[str, Callable]] = {"token": int, "logprobs": _logprob_entries}

    def to_bytes(self) -> bytes:
        return msgpack.packb({"v": WIRE_VERSION, "b": {"token": self.token, "logprobs": list(self.logprobs)}})

    @classmethod
    def from_bytes(cls, data: bytes) -> "FirstToken":
        """Raises KVWireError on anything but what `to_bytes` of this wire version wrote."""
        try:
            w = msgpack.unpackb(data)
        except (TypeError, ValueError, msgpack.UnpackException) as e:
            raise KVWireError(f"the first-token state is not msgpack: {e!r}") from None
        _check_frame(w, {"v", "b"}, "first-token state")
        return cls(**_decode_body("first-token state", w["b"], cls._DECODERS))
