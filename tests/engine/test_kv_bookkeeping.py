"""Rank 0's KV bookkeeping on its own, with plain factories (no model, no transfer agent): the tally of
every rank's reports, the directory of peers' RankInfos, and what the KV exchange commands and settles
for the scheduler."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import msgpack
import pytest

from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv.connector import PeerDirectory, TransferTally
from pdserve.engine.kv.wire import CancelKV, FirstToken, ForgetPeer, RankReport, ReceiveKV, SendKV
from pdserve.engine.kv.exchange import KVExchange
from pdserve.engine.sampler import SampleResult
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import DisaggInfo, FinishReason, RequestType, Sequence, SeqState

EP = "tcp://ctx:1"
INFOS = [b"rank-info-0", b"rank-info-1"]


def _until(cond, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.001)
    raise AssertionError("timed out")


# -- TransferTally ----------------------------------------------------------------------------------


def test_a_transfer_settles_only_once_every_rank_reported():
    t = TransferTally(2)
    t.add(0, RankReport(done=[5]))
    assert t.settled() == {}
    t.add(1, RankReport(done=[5]))
    assert t.settled() == {5: None}
    assert t.settled() == {}  # reported once


def test_one_failing_rank_fails_the_transfer_with_its_reason():
    t = TransferTally(3)
    t.add(0, RankReport(done=[5]))
    t.add(1, RankReport(failed={5: "timed out"}))
    t.add(2, RankReport(cancelled=[5]))
    assert t.settled() == {5: "timed out"}


def test_cancelled_counts_as_a_report_but_never_overrides_one():
    t = TransferTally(2)
    t.add(0, RankReport(done=[5]))
    t.add(0, RankReport(cancelled=[5]))  # the same rank: its "done" stands
    t.add(1, RankReport(cancelled=[5, 6]))
    assert t.settled() == {5: "cancelled"}
    t.add(0, RankReport(cancelled=[6]))
    assert t.settled() == {6: "cancelled"}


def test_delivered_tokens_and_states_are_read_from_rank_0_only():
    t = TransferTally(2)
    t.add(1, RankReport(done=[5], tokens={5: 99}, states={5: b"x"}))
    t.add(0, RankReport(done=[5], tokens={5: 12}, states={5: b"s"}))
    assert (t.tokens, t.states) == ({5: 12}, {5: b"s"})
    assert t.settled() == {5: None}


def test_rank_reports_round_trip_their_wire_form():
    r = RankReport(done=[1], failed={2: "x"}, cancelled=[3], tokens={4: 5}, states={6: b"\x00"})
    assert RankReport.from_wire(msgpack.unpackb(msgpack.packb(r.to_wire()))) == r


# -- PeerDirectory ----------------------------------------------------------------------------------


class _Fetch:
    """A fetch that waits for `release` and counts its calls; `error` makes it raise."""

    def __init__(self, error: Exception | None = None):
        self.calls: list[str] = []
        self.release = threading.Event()
        self.error = error

    def __call__(self, endpoint: str) -> list[bytes]:
        self.calls.append(endpoint)
        self.release.wait(5)
        if self.error is not None:
            raise self.error
        return INFOS


def test_a_new_peer_is_fetched_off_the_caller_then_cached():
    fetch = _Fetch()
    peers = PeerDirectory(fetch)
    try:
        assert peers.lookup(EP) is None  # submitted
        assert peers.lookup(EP) is None  # still fetching: not submitted twice
        fetch.release.set()
        assert _until(lambda: peers.lookup(EP)) == INFOS
        assert peers.lookup(EP) == INFOS and fetch.calls == [EP]
        peers.forget(EP)
        assert peers.lookup(EP) is None
        assert _until(lambda: peers.lookup(EP)) == INFOS and fetch.calls == [EP, EP]
    finally:
        peers.close()


def test_a_failed_fetch_is_reported_once_then_tried_again():
    fetch = _Fetch(ConnectionError("refused"))
    fetch.release.set()
    peers = PeerDirectory(fetch)
    try:
        assert peers.lookup(EP) is None
        err = _until(lambda: peers.lookup(EP))
        assert isinstance(err, ConnectionError)
        assert peers.lookup(EP) is None  # a new attempt
        assert isinstance(_until(lambda: peers.lookup(EP)), ConnectionError) and len(fetch.calls) == 2
    finally:
        peers.close()


# -- KVExchange: commands and settling, for the scheduler -------------------------------------------


@pytest.fixture
def exchange():
    """make(fetch, world_size) -> (KVExchange, Scheduler) over a fake connector; closed after the test."""
    made: list[KVExchange] = []

    def make(fetch=None, world_size: int = 2) -> tuple[KVExchange, Scheduler]:
        s = Scheduler(BlockManager(8, 4), 8, 64, True)
        # (wait: an idle step's wait for a control message or a finished write, which this fake never has)
        tx = SimpleNamespace(fetch_instance=fetch or (lambda ep: INFOS), control_pending=False,
                             wait=lambda timeout_s: None)
        kv = KVExchange(s, SimpleNamespace(tx=tx), EngineConfig(tensor_parallel_size=world_size, tokens_per_block=4),
                        vocab_size=512)
        made.append(kv)
        return kv, s

    yield make
    for kv in made:
        kv.close()


def _generation(s: Scheduler, **disagg) -> Sequence:
    d = DisaggInfo(5, EP, 0, **disagg)
    g = Sequence("g", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), RequestType.GENERATION_ONLY, disagg=d)
    g.output_token_ids = list(d.first_gen_tokens)
    s.add(g)
    s.schedule()
    return g


def _recv(kv: KVExchange) -> list[ReceiveKV]:
    """commands() until the peer's RankInfos are in and the receive is asked for."""
    return _until(lambda: [c for c in kv.commands() if isinstance(c, ReceiveKV)])


def _receiving(exchange, **disagg) -> tuple[KVExchange, Scheduler, Sequence]:
    """A generation_only request (on two ranks) whose receive every rank was told to start."""
    kv, s = exchange()
    g = _generation(s, **disagg)
    _recv(kv)
    return kv, s, g


def test_a_parked_generation_request_is_received_once_its_peer_is_known(exchange):
    kv, s = exchange()
    g = _generation(s, first_gen_tokens=(42,))
    [cmd] = _recv(kv)
    assert cmd == ReceiveKV(5, EP, (0, 1), 0, tuple(INFOS), cmd.timeout_ms, False) and 29_000 < cmd.timeout_ms <= 30_000
    assert g.disagg.transfer_started and g.disagg.kv_deadline is not None
    assert kv.commands() == []  # asked once
    kv.settle([], [[RankReport(done=[5], tokens={5: 5}), RankReport()]])
    assert g.state is SeqState.GEN_AWAITING_KV  # rank 1 has not reported yet
    kv.settle([], [[RankReport(), RankReport(done=[5])]])
    assert g.state is SeqState.RUNNING and g.disagg.transfer_settled
    [out] = s.take_outputs()
    assert (out.new_token_ids, out.finished) == ([42], False)


def test_generation_first_the_first_token_rides_with_the_kv(exchange):
    kv, s, g = _receiving(exchange, schedule_style="generation_first")
    state = FirstToken(42).to_bytes()
    kv.settle([], [[RankReport(done=[5], states={5: state}), RankReport(done=[5])]])
    assert g.state is SeqState.RUNNING and g.output_token_ids == [42]


def test_kv_for_another_prompt_length_fails_the_request(exchange):
    kv, s, g = _receiving(exchange, first_gen_tokens=(42,))
    kv.settle([], [[RankReport(done=[5], tokens={5: 4}), RankReport(done=[5])]])
    [out] = s.take_outputs()
    assert out.finished and "sent KV for 4 prompt tokens but this request's prompt has 5" in out.error
    assert g.finish_reason is FinishReason.ERROR and s.seqs == {} and s.blocks.num_free_blocks == 8
    assert kv.commands() == [ForgetPeer(EP)]  # the peer may have restarted: every rank re-learns it


def test_one_rank_failing_cancels_the_others_then_the_request_fails(exchange):
    kv, s, g = _receiving(exchange, first_gen_tokens=(42,))
    kv.settle([], [[RankReport(failed={5: "TimeoutError: no write"}), RankReport()]])
    assert s.cancels == [5] and g.state is SeqState.GEN_AWAITING_KV
    assert kv.commands() == [CancelKV(5)] and s.cancels == []
    kv.settle([], [[RankReport(), RankReport(cancelled=[5])]])
    [out] = s.take_outputs()
    assert out.error == f"KV transfer from {EP} failed: TimeoutError: no write"
    assert s.seqs == {} and s.blocks.num_free_blocks == 8


def test_a_peer_that_does_not_answer_fails_the_request_before_any_transfer(exchange):
    fetch = _Fetch(ConnectionError("refused"))
    fetch.release.set()
    kv, s = exchange(fetch)
    g = _generation(s, first_gen_tokens=(42,))
    _until(lambda: (kv.commands(), s.outputs)[1])
    [out] = s.take_outputs()
    assert out.error == f"KV transfer failed: context instance at {EP} did not answer: refused"
    assert not g.disagg.transfer_started and s.seqs == {} and s.blocks.num_free_blocks == 8


def test_first_contact_times_out_at_the_deadline(exchange):
    fetch = _Fetch()
    kv, s = exchange(fetch)
    g = _generation(s, first_gen_tokens=(42,))
    g.disagg.kv_deadline = time.monotonic() - 1  # admitted longer ago than kv_transfer_timeout_ms
    try:
        assert kv.commands() == []
    finally:
        fetch.release.set()
    [out] = s.take_outputs()
    assert out.error.startswith(f"KV transfer failed: timed out at first contact: the context instance at {EP}")


def test_a_prefilled_context_request_offers_its_whole_prompt_then_ends_when_sent(exchange):
    kv, s = exchange(world_size=1)
    c = Sequence("c", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), RequestType.CONTEXT_ONLY, disagg=DisaggInfo(9))
    s.add(c)
    batch = s.schedule()
    s.postprocess(batch, SampleResult([77], [None], [None]))
    kv.settle(batch, [None])
    assert kv.commands() == [SendKV(9, (0, 1), 0, 5, True, b"")] and c.disagg.transfer_started
    assert c.state is SeqState.CTX_TRANSMITTING
    kv.settle([], [[RankReport(done=[9])]])
    assert c.state is SeqState.FINISHED and s.seqs == {} and s.blocks.num_free_blocks == 8


def test_a_pipelined_prefill_offers_each_chunks_full_blocks(exchange):
    kv, s = exchange(world_size=1)
    s.max_num_tokens = 6
    d = DisaggInfo(9, schedule_style="generation_first", pipelined=True)
    c = Sequence("c", list(range(1, 11)), SamplingParams(max_tokens=4), RequestType.CONTEXT_ONLY, disagg=d)
    s.add(c)
    sends = []
    for token in ([], [77]):
        batch = s.schedule()
        s.postprocess(batch, SampleResult(token, [None] * len(token), [None] * len(token)))
        kv.settle(batch, [None])
        sends += kv.commands()
    state = FirstToken(77).to_bytes()
    assert sends == [SendKV(9, (0, -1, -1), 0, 4, False, b""), SendKV(9, (-1, 1, 2), 4, 10, True, state)]
