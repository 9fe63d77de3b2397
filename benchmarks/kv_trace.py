"""bench_kv_transfer.py --trace: where a context_first transfer's time goes, stage by stage.

Both processes of a case stamp CLOCK_MONOTONIC (time.perf_counter, the same clock in both) at the
transceiver's stages into a file each. The stamps come from wrappers this module puts around the
transceiver's methods inside the benchmark's own processes; pdserve's code is not changed, and a run
without --trace wraps nothing. The stages of one request, in the order they happen:

    asked      gen  request_and_receive_async called: the rep's clock starts
    sent       gen  its REQUEST_DATA handed to ZeroMQ (ControlPlane.send returned)
    received   ctx  the control listener thread decoded it (ControlPlane._on_message)
    applied    ctx  the executor thread took it from the queue (Sender.on_request_data)
    planned    ctx  plan_write returned
    submitted  ctx  the agent's submit_write returned (NIXL over UCX's shared memory copies in it)
    notified   gen  the write's TransferDone notification applied (Receiver.on_written)
    reported   gen  check_gen_transfer_status returned the request: the rep's clock stops

`report` prints the median gap before each stage over the timed context_first reps (ids 1..reps:
the warm-up is id 0, generation_first reps are 100000 and up). A wrapper costs a few microseconds
a stage, so a traced run reads a little slower than an untraced one.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from pathlib import Path

STAGES = ("asked", "sent", "received", "applied", "planned", "submitted", "notified", "reported")
GEN_FIRST_IDS = 100_000


class _Stamps:
    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)
        self.current = -1  # the request the ctx executor works on (plan and submit carry no id)

    def __call__(self, stage: str, rid: int | None = None) -> None:
        t = time.perf_counter()
        self.file.write(f"{t:.7f} {stage} {self.current if rid is None else int(rid)}\n")


def _after(owner, name: str, stamp) -> None:
    """Wrap `owner.name` so that `stamp(result, *args)` runs after it."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        result = inner(*args, **kwargs)
        stamp(result, *args)
        return result

    setattr(owner, name, wrapper)


def _before(owner, name: str, stamp) -> None:
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        stamp(*args)
        return inner(*args, **kwargs)

    setattr(owner, name, wrapper)


def install(trace_dir: str, role: str) -> None:
    """Wrap the stages of `role` ("gen" or "ctx") in this process; call before any transceiver is built."""
    from pdserve.kv_transfer.agents.base import TransferAgent
    from pdserve.kv_transfer.control.messages import RequestData
    from pdserve.kv_transfer.transceiver import kv_transceiver, sender
    from pdserve.kv_transfer.transceiver.control_plane import ControlPlane
    from pdserve.kv_transfer.transceiver.receiver import Receiver

    stamp = _Stamps(Path(trace_dir) / f"{role}-{os.getpid()}.txt")
    if role == "gen":
        _before(kv_transceiver.KVTransceiver, "request_and_receive_async", lambda tx, rid, *_: stamp("asked", rid))
        _after(ControlPlane, "send", lambda _, cp, endpoint, message: isinstance(message, RequestData)
               and stamp("sent", message.disagg_id))
        _after(Receiver, "on_written", lambda _, receiver, done: stamp("notified", done.disagg_id))

        def reported(results, *_):
            for rid in results.completed:
                stamp("reported", rid)
        _after(kv_transceiver.KVTransceiver, "check_gen_transfer_status", reported)
        return

    def received(cp, message):
        if isinstance(message, RequestData):
            stamp("received", message.disagg_id)

    def applied(_, message):
        stamp.current = message.disagg_id
        stamp("applied")

    _before(ControlPlane, "_on_message", received)  # before the listener binds it (at the transceiver's start)
    _before(sender.Sender, "on_request_data", applied)
    _after(sender, "plan_write", lambda *_: stamp("planned"))
    for agent_class in _subclasses(TransferAgent):
        if "submit_write" in vars(agent_class):
            _after(agent_class, "submit_write", lambda *_: stamp("submitted"))


def _subclasses(cls) -> list[type]:
    import pdserve.kv_transfer.agents.nixl  # noqa: F401  (the agents the benchmark makes)
    import pdserve.kv_transfer.agents.shm  # noqa: F401

    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo += c.__subclasses__()
    return out


def report(trace_dir: str, reps: int) -> str:
    """The table of median gaps before each stage (ms), over the timed context_first reps."""
    at: dict[int, dict[str, float]] = {}
    for path in Path(trace_dir).glob("*.txt"):
        for line in path.read_text().splitlines():
            t, stage, rid = line.split()
            at.setdefault(int(rid), {}).setdefault(stage, float(t))  # a stage's first stamp per request
    timed = [s for rid, s in at.items() if 1 <= rid <= reps and all(stage in s for stage in STAGES)]
    if not timed:
        return "trace: no rep holds every stage"
    lines = [f"trace of {len(timed)} context_first reps: median ms before each stage (and since 'asked')"]
    for prev, stage in zip(STAGES, STAGES[1:]):
        gap = statistics.median(s[stage] - s[prev] for s in timed)
        since = statistics.median(s[stage] - s["asked"] for s in timed)
        lines.append(f"  {stage:>9} {gap * 1e3:7.3f}  ({since * 1e3:6.3f})")
    return "\n".join(lines)
