"""KVTransceiver: one rank's end of the KV exchange (the package docstring draws its use)."""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import numpy as np

from pdserve.kv_transfer.agents.base import TransferAgent
from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.rank_info import RankInfo
from pdserve.kv_transfer.sessions import RecvSession, SendSession, TransferResults
from pdserve.kv_transfer.transceiver.base import Local, TransceiverConfig
from pdserve.kv_transfer.transceiver.bouncer import Bouncer
from pdserve.kv_transfer.transceiver.control_plane import ControlPlane
from pdserve.kv_transfer.transceiver.receiver import Receiver
from pdserve.kv_transfer.transceiver.sender import Sender

# How long a wait sleeps when nothing wakes it: control messages wake it at once, and so do finished
# writes and notifications of an agent that signals them (TransferAgent.set_waker). What is left to
# notice by the clock is a session's deadline or a lost writer (peer_lost_ms), for which 10 ms is soon.
# An agent that cannot signal (NIXL) is polled at its own completion_poll_s instead.
HOUSEKEEPING_S = 0.01


class KVTransceiver:
    def __init__(self, agent: TransferAgent, config: TransceiverConfig | None = None,
                 host: str = "127.0.0.1") -> None:
        self.agent = agent
        self.config = config or TransceiverConfig()
        self._local = Local(agent, self.config)
        if self.config.checksum and self._local.kv_on_device():
            raise KVTransferError("checksum needs the KV cache in host memory; this rank registered device memory "
                                  "(turn cache_transceiver_config.checksum off)")
        self._bouncer = Bouncer(self._local)
        self._control = ControlPlane(self._local, host)
        self._send = Sender(self._local, self._control, self._bouncer)
        self._recv = Receiver(self._local, self._control, self._bouncer)
        self._control.connect(self._send, self._recv)
        agent.set_waker(self._control.wake.set)  # a finished write or a notification ends a wait()
        # The parts' own tables and counters (one object each, never replaced): empty tables mean "all done".
        self.send_sessions: dict[int, SendSession] = self._send.sessions
        self.recv_sessions: dict[int, RecvSession] = self._recv.sessions
        self.stats: dict[str, int] = self._local.stats
        # Cumulative seconds of this rank's CPU stages: plan, gather, submit, scatter, checksum.
        self.stage_seconds: dict[str, float] = self._local.stage_seconds

    # -- setup --------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return self._control.messenger.endpoint

    def local_descriptor(self) -> bytes:
        return self.agent.local_descriptor()

    def start(self, own: RankInfo, instance_ranks: Sequence[RankInfo] | None = None) -> None:
        """Publish this rank (and its instance, answered to RankInfo requests)."""
        ranks = tuple(sorted(instance_ranks or (own,), key=lambda r: r.rank))
        if own not in ranks or len({r.instance_name for r in ranks}) != 1:
            raise ValueError("instance_ranks must hold this rank's RankInfo and only ranks of its instance")
        if [r.rank for r in ranks] != list(range(len(ranks))):
            raise ValueError(f"instance_ranks must be ranks 0..n-1, got {[r.rank for r in ranks]}")
        self._local.own, self._local.instance = own, ranks
        self._control.publish(ranks)

    def close(self) -> None:
        """Stop the listener and deregister the staging buffer; the caller still owns the agent."""
        self.agent.set_waker(None)
        self._control.close()
        self._bouncer.close()

    # -- context side -------------------------------------------------------------------------
    def respond_and_send_async(self, disagg_id: int, block_ids: Mapping[int, np.ndarray], *,
                               token_range: tuple[int, int] = (0, 0), last: bool = True, state: bytes = b"") -> None:
        """Offer this rank's KV of `disagg_id` (layer-group id -> src block ids, -1 = skip).

        One call with `last=True` offers the whole prompt. A pipelined send calls once per prefill
        chunk, `last=False` until the final one; every call's ids are positional over the whole
        prompt (blocks not in this chunk are -1), so the receiver's one slice serves all chunks.
        `token_range`: the exact prompt tokens the chunk completes (reported to the receiver); a
        chunk starting after token 0 continues a send, and is dropped if that send already ended.
        `state`: small bytes delivered with the last chunk (e.g. the first generated token)."""
        self._send.respond_and_send_async(disagg_id, block_ids, token_range, last, state)

    def check_context_transfer_status(self, at_least: int = 0) -> TransferResults:
        """Finished send sessions (their KV may be freed); waits until `at_least` finished, clamped to
        the sessions in flight so an idle loop never sleeps out a timeout."""
        return self._check(self.send_sessions, self._send.canaries, at_least, self._send.step)

    def poll_control(self) -> None:
        """Context side with no send session: apply what peers sent meanwhile (REQUEST_DATA that came
        before our offer, CANCELs), and refuse parked requests that waited kv_transfer_timeout_ms."""
        self._control.drain()
        self._send.expire_early()

    def on_control_message(self, notify: Callable[[], None]) -> None:
        """Call `notify` (on the listener thread; it must not block) whenever a control message is queued
        for `poll_control`: an executor that sleeps while idle wakes to answer it."""
        self._control.notify = notify

    @property
    def control_pending(self) -> bool:
        """Whether `poll_control` has anything to do."""
        return not self._control.events.empty() or bool(self._send.early)

    # -- generation side ----------------------------------------------------------------------
    def request_and_receive_async(self, disagg_id: int, ctx_endpoint: str,
                                  block_ids: Mapping[int, np.ndarray], token_range: tuple[int, int] = (0, 0),
                                  ctx_dp_rank: int = 0, timeout_ms: float | None = None,
                                  wait_for_offer: bool = True) -> None:
        """Ask the context instance at `ctx_endpoint` (rank 0's control endpoint) to write
        `disagg_id`'s KV into our blocks (layer-group id -> dst block ids, -1 = skip).
        `ctx_dp_rank`: the context DP group that holds the request (0 without attention DP).
        `timeout_ms`: what is left of the request's transfer timeout (default: all of it).
        `wait_for_offer`: the context side may not hold the request yet and parks the ask until it
        does; False when it must hold it already (it answered first), so that a request it does not
        hold fails at once, reported in `TransferResults.unknown`."""
        self._recv.request_and_receive_async(disagg_id, ctx_endpoint, block_ids, token_range, ctx_dp_rank,
                                             timeout_ms, wait_for_offer)

    def check_gen_transfer_status(self, at_least: int = 0) -> TransferResults:
        """Finished receive sessions (their KV is in place); `at_least` as for the context side."""
        return self._check(self.recv_sessions, self._recv.canaries, at_least, self._recv.step)

    def fetch_instance(self, endpoint: str) -> list[bytes]:
        """The RankInfos (as bytes) of the context instance at `endpoint`, asked over the network.
        Safe from any thread, so an executor can fetch a new peer without stalling its step loop,
        then hand the answer to every rank through `add_instance`. Raises TimeoutError when nothing
        answers within rank_info_timeout_s."""
        return self._control.fetch_instance(endpoint)

    def add_instance(self, endpoint: str, rank_infos: Sequence[bytes]) -> None:
        """Cache a context instance's RankInfos (from `fetch_instance`), so no request pays the round trip."""
        self._control.add_instance(endpoint, rank_infos)

    def forget_instance(self, endpoint: str) -> None:
        """Drop a cached context instance (e.g. after a failure: it may have restarted, so the next
        contact runs the canary again)."""
        self._recv.forget_instance(endpoint)

    # -- both ---------------------------------------------------------------------------------
    def has_inflight_transfer(self) -> bool:
        return bool(self.send_sessions or self.recv_sessions)

    def cancel_request(self, disagg_id: int) -> bool:
        """False while a write of this request may still land (call again next step); True once its
        blocks may be freed or reused. Unknown ids are True."""
        self._control.drain()
        if disagg_id in self.send_sessions:
            return self._send.cancel(disagg_id)
        if disagg_id in self.recv_sessions:
            return self._recv.cancel(disagg_id)
        self._send.forget(disagg_id)
        return True

    @property
    def canary_writes(self) -> int:
        """First-contact canaries this rank wrote (kept out of `stats`)."""
        return self._send.canary_writes

    def wait(self, timeout_s: float) -> bool:
        """Sleep until something may have changed (a control message; a finished write or a notification)
        or `timeout_s` passed; True when woken. An executor with transfers in flight and nothing else to
        do sleeps here instead of a fixed sleep; the next status check reports what woke it. An agent
        that cannot signal (NIXL) is polled meanwhile at its completion_poll_s, while transfers are in
        flight: its writes (which sends their notifications) and its notifications."""
        wake, poll_s = self._control.wake, self.agent.completion_poll_s
        if poll_s is None or not self.has_inflight_transfer():
            woke = wake.wait(timeout_s)
            wake.clear()  # whatever set it is still queued (control messages) or pollable (agent): not lost
            return woke
        deadline = time.monotonic() + timeout_s
        while True:
            wake.clear()
            if self._control.drain() + self._send.poll_writes():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if wake.wait(min(poll_s, left)):
                wake.clear()
                return True

    def _check(self, table: dict, canaries: set[int], at_least: int,
               step: Callable[[], TransferResults]) -> TransferResults:
        want = min(max(at_least, 0), sum(1 for rid in table if rid not in canaries))
        wake = self._control.wake
        wake.clear()  # before the step, which drains the queue: no wake-up is lost
        self._control.drain()
        results = step()
        sleep_s = self.agent.completion_poll_s or HOUSEKEEPING_S
        while len(results) < want:
            wake.wait(sleep_s)
            wake.clear()
            self._control.drain()
            results.merge(step())
        return results

    # -- what it holds, read by monitoring and tests ---------------------------------------------
    @property
    def messenger(self):
        """The control-plane socket: its endpoint, liveness and counters (dropped messages, auth failures)."""
        return self._control.messenger

    @property
    def parked_requests(self) -> dict:
        """Context side: REQUEST_DATA that arrived before its request's KV was ready, by request id."""
        return self._send.early

    @property
    def canary_gates(self) -> dict:
        """Generation side: the first-contact canary gate of each context instance, by its endpoint."""
        return self._recv.gates

    @property
    def gen_peers(self) -> dict:
        """Context side: the generation ranks that registered with this one (their RankInfos)."""
        return self._send.gen_peers

    @property
    def staging(self):
        """The bounce buffer, or None when writes land in the KV pool directly."""
        return self._bouncer.staging
