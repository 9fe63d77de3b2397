"""The engine's typed wires: the KV exchange's rank wire (engine/kv/wire.py: every command, the rank
report, the first-token state), the step spec with its sampling specs, and the KV event frames. Each
round trips through msgpack; another version, an unknown kind or a wrong field set is refused."""

import msgpack
import pytest

from pdserve.engine.block_manager import KVEvent
from pdserve.engine.kv.events import EVENTS_VERSION, KVEventBatch, KVEventError
from pdserve.engine.kv.wire import (WIRE_VERSION, CancelKV, FirstToken, ForgetPeer, KVWireError, RankReport, ReceiveKV,
                                    SendKV, command_from_wire, command_to_wire)
from pdserve.engine.model_runner import SeqStep, StepSpec
from pdserve.engine.sampler import SampleSpec

COMMANDS = [
    SendKV(9, (0, -1, 2), 0, 40, True, b"\x81state"),
    SendKV(9, (), 4, 10, False, b""),
    ReceiveKV(5, "tcp://10.0.0.1:5555", (3, 4), 1, (b"rank-info-0", b"rank-info-1"), 29_000, False),
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
    r = RankReport(done=[1], failed={2: "x"}, cancelled=[3], tokens={4: 5}, states={6: b"\x00"}, unknown=[2])
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
    with pytest.raises(KVWireError, match=r"CANCEL has fields \['id'\], expected \['disagg_id'\]"):
        command_from_wire(w | {"b": {"id": 7}})
    send = command_to_wire(SendKV(9, (0,), 0, 4, True, b""))
    send["b"]["block_ids"] = 7
    with pytest.raises(KVWireError, match="malformed SEND"):
        command_from_wire(send)


def test_the_sampling_spec_rides_the_step_spec_typed():
    sample = SampleSpec(temperature=0.7, top_k=5, seed=3, step=2, logprobs=1, history=[1, 2],
                        logit_bias=[(4, 1.5)], banned=[9])
    back = StepSpec.from_bytes(StepSpec([SeqStep([1, 2], 0, [0], sample), SeqStep([3], 7, [1], None)]).to_bytes())
    assert back.seqs[0].sample == SampleSpec(temperature=0.7, top_k=5, seed=3, step=2, logprobs=1, history=[1, 2],
                                             logit_bias=[[4, 1.5]], banned=[9])
    assert back.seqs[1].sample is None


def test_a_step_spec_of_another_wire_version_is_refused():
    w = msgpack.unpackb(StepSpec([]).to_bytes()) | {"v": WIRE_VERSION + 1}
    with pytest.raises(KVWireError, match="same pdserve version"):
        StepSpec.from_bytes(msgpack.packb(w))


def test_the_first_token_state_round_trips_and_refuses_anything_else():
    first = FirstToken(42, ({"token_id": 42, "logprob": -0.5, "top": [(42, -0.5), (7, -1.0)]},))
    assert FirstToken.from_bytes(first.to_bytes()) == first
    assert FirstToken.from_bytes(FirstToken(3).to_bytes()) == FirstToken(3)
    for bad, why in [(b"\xc1", "not msgpack"), (msgpack.packb({"token": 3}), "keys"),
                     (msgpack.packb({"v": WIRE_VERSION + 1, "b": {"token": 3, "logprobs": []}}), "wire version"),
                     (msgpack.packb({"v": WIRE_VERSION, "b": {"token": 3, "logprobs": [{"id": 1}]}}), "logprob entry")]:
        with pytest.raises(KVWireError, match=why):
            FirstToken.from_bytes(bad)


def test_kv_event_frames_round_trip_and_refuse_another_version_or_kind():
    batch = KVEventBatch(7, (KVEvent("stored", [1, 2], None), KVEvent("removed", [3], 2)))
    assert KVEventBatch.from_bytes(batch.to_bytes()) == batch
    for bad, why in [(msgpack.packb([7, [["stored", [1], None]]]), "map with keys"),
                     (msgpack.packb({"v": EVENTS_VERSION + 1, "seq": 1, "events": []}), "same pdserve version"),
                     (msgpack.packb({"v": EVENTS_VERSION, "seq": 1, "events": [["moved", [1], None]]}), "unknown"),
                     (msgpack.packb({"v": EVENTS_VERSION, "seq": 1, "events": [["stored", "x", None]]}), "malformed")]:
        with pytest.raises(KVEventError, match=why):
            KVEventBatch.from_bytes(bad)
