"""The KV exchange's rank wire (engine/kv_wire.py): every command and the rank report round trip
through msgpack; another version, an unknown kind or a wrong field set is refused."""

import msgpack
import pytest

from pdserve.engine.kv_wire import (WIRE_VERSION, CancelKV, ForgetPeer, KVWireError, RankReport, ReceiveKV, SendKV,
                                    command_from_wire, command_to_wire)
from pdserve.engine.model_runner import SeqStep, StepSpec

COMMANDS = [
    SendKV(9, (0, -1, 2), 0, 40, True, b"\x81state"),
    SendKV(9, (), 4, 10, False, b""),
    ReceiveKV(5, "tcp://10.0.0.1:5555", (3, 4), 1, (b"rank-info-0", b"rank-info-1"), 29_000),
    CancelKV(7),
    ForgetPeer("tcp://10.0.0.1:5555"),
]


def _through_msgpack(w):
    return msgpack.unpackb(msgpack.packb(w))


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: type(c).__name__)
def test_every_command_round_trips(cmd):
    back = command_from_wire(_through_msgpack(command_to_wire(cmd)))
    assert back == cmd and type(back) is type(cmd)


def test_the_step_spec_carries_its_commands_typed():
    spec = StepSpec([SeqStep([1, 2], 0, [0], None)], list(COMMANDS))
    assert StepSpec.from_bytes(spec.to_bytes()).kv == COMMANDS


def test_rank_report_round_trips():
    r = RankReport(done=[1], failed={2: "x"}, cancelled=[3], tokens={4: 5}, states={6: b"\x00"})
    assert RankReport.from_wire(_through_msgpack(r.to_wire())) == r
    assert RankReport.from_wire(_through_msgpack(RankReport().to_wire())) == RankReport()


def test_another_wire_version_is_refused():
    w = command_to_wire(CancelKV(7)) | {"v": WIRE_VERSION + 1}
    with pytest.raises(KVWireError, match=f"wire version {WIRE_VERSION + 1}.*same pdserve version"):
        command_from_wire(w)
    r = RankReport().to_wire() | {"v": WIRE_VERSION + 1}
    with pytest.raises(KVWireError, match="rank report has wire version"):
        RankReport.from_wire(r)


def test_an_unknown_command_kind_is_refused():
    with pytest.raises(KVWireError, match="unknown KV command kind 99"):
        command_from_wire(command_to_wire(CancelKV(7)) | {"t": 99})


def test_a_positional_list_is_refused():
    with pytest.raises(KVWireError, match="must be a map"):
        command_from_wire(["cancel", 7])


def test_a_wrong_field_set_is_refused():
    w = command_to_wire(CancelKV(7))
    with pytest.raises(KVWireError, match=r"CANCEL has fields \['id'\], expected \['request_id'\]"):
        command_from_wire(w | {"b": {"id": 7}})
    send = command_to_wire(SendKV(9, (0,), 0, 4, True, b""))
    send["b"]["block_ids"] = 7
    with pytest.raises(KVWireError, match="malformed SEND"):
        command_from_wire(send)
