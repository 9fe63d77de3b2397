"""An asyncio front for `LLMEngine`: the engine steps in its own thread; callers await outputs.

The step thread is the only one that touches the engine, and it builds the engine too: OpenMP keeps one
team of worker threads per thread that starts parallel work, and once a process holds more OpenMP
threads than cores, libgomp's workers barely spin before sleeping between parallel regions, so a
model loaded in one thread and stepped in another would leave two teams and slow every step.

Callers talk to the step thread through a command queue (add, abort) and get results through one
asyncio.Queue per request, filled with `loop.call_soon_threadsafe`. The loop never blocks on a caller,
and an idle engine sleeps on the command queue, not in a poll.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, RequestError, StepRecord
from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.kv.events import KVEventPublisher
from pdserve.engine.sequence import DisaggInfo, RequestType, Resume, num_answers

log = logging.getLogger(__name__)


@dataclass
class _Add:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str | None
    request_type: RequestType
    disagg: DisaggInfo | None
    sink: Callable[[RequestOutput], bool]  # False once the caller can no longer receive
    resume: Resume | None = None
    done: Future = field(default_factory=Future)


@dataclass
class _Abort:
    """Abort `request_id`, or else whatever request `add` created (nothing if it was refused or never
    taken): a caller cancelled while its add was in the queue cannot know the id yet."""

    request_id: str | None = None
    add: _Add | None = None


class _Wake:
    """Nothing to apply: the engine thread wakes and steps if it has KV control messages to read."""


@dataclass
class _Call:
    """Run a function on the engine thread (for helpers that must not race the step loop)."""

    fn: Callable[[LLMEngine], object]
    done: Future = field(default_factory=Future)


class AsyncEngine:
    def __init__(self, build: Callable[[], LLMEngine], kv_events: KVEventPublisher | None = None):
        """`build` makes the engine, on the engine thread; its exception is raised here."""
        self.kv_events = kv_events
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, Callable[[RequestOutput], bool]] = {}
        self._open: dict[str, int] = {}  # choices of each request with a sink that have not finished
        self._stop = threading.Event()
        self.error: str | None = None  # set if the step loop died; /health reports it
        # Called (on the engine thread) once the step loop died: the server stops, so that the process
        # exits non-zero and its supervisor (pdserve launch, Ray, Kubernetes) restarts it.
        self.on_death: Callable[[str], None] | None = None
        self.on_step: Callable[[list[RequestOutput]], None] | None = None
        self.on_step_record: Callable[[StepRecord], None] | None = None  # each step that ran sequences
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="pdserve-engine", daemon=True)
        self._thread.start()
        engine = self.engine = built.result()
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.sampling_defaults = engine.sampling_defaults
        self.kv_endpoint = engine.kv_endpoint
        self.ecfg = engine.ecfg
        self.vocab_size = engine.model_cfg.vocab_size
        self.grammars = engine.guides.grammars  # compiles a request's grammar before it is added (and caches it)

    @classmethod
    def from_config(cls, ecfg: EngineConfig, kv_events_port: int | None = None, **kwargs) -> "AsyncEngine":
        """`kv_events_port`: publish KV cache events there (0 = a free port; None = off)."""
        publisher = None
        if kv_events_port is not None:
            publisher = KVEventPublisher(ecfg.cache_transceiver_config.host, kv_events_port)
        try:
            return cls(lambda: LLMEngine(ecfg, on_kv_event=publisher, **kwargs), publisher)
        except BaseException:
            if publisher is not None:
                publisher.close()
            raise

    # -- caller side (any thread, usually the event loop) -------------------------------------------

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       request_type: RequestType = RequestType.CONTEXT_AND_GENERATION,
                       disagg: DisaggInfo | None = None, resume: Resume | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (with n > 1, every choice's, each output naming its `index`; the stream
        ends when each has finished). Raises RequestError before the first output if it is refused.
        Abandoning the iterator (client gone) aborts the request and frees its KV blocks."""
        if self.error:
            raise RuntimeError(f"engine is not running: {self.error}")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> bool:
            """Hand `out` to this caller; False once its event loop is closed (nobody will read it)."""
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:
                return False
            return True

        cmd = _Add(prompt_token_ids, params, request_id, request_type, disagg, sink, resume)
        self._commands.put(cmd)
        try:
            rid = await asyncio.wrap_future(cmd.done)
        except asyncio.CancelledError:
            # Gone before the engine answered. If the engine already took the add, the request exists
            # and nobody would read it: abort it (queued after the add, so applied after it).
            self._commands.put(_Abort(add=cmd))
            raise
        open_choices = num_answers(request_type, params.n)
        try:
            while open_choices:
                out = await outputs.get()
                open_choices -= out.finished
                yield out
        finally:
            if open_choices:
                self._commands.put(_Abort(rid))

    async def call(self, fn: Callable[[LLMEngine], object]):
        if self.error:
            raise RuntimeError(f"engine is not running: {self.error}")
        cmd = _Call(fn)
        self._commands.put(cmd)
        return await asyncio.wrap_future(cmd.done)

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=30)
        # After the loop died the other ranks may be gone or mid-step: they are killed, not asked to stop.
        self.engine.shutdown(graceful=self.error is None)
        if self.kv_events is not None:
            self.kv_events.close()

    # -- engine thread ------------------------------------------------------------------------------

    def _run(self, build: Callable[[], LLMEngine], built: Future) -> None:
        try:
            self.engine = build()
            self.stats = self.engine.stats()
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(self.engine)
        self.engine.wake_on_kv_control(lambda: self._commands.put(_Wake()))
        self._loop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    # Recorded before the outputs go out: whoever sees a step's tokens can see its record.
                    if self.on_step_record is not None and self.engine.last_step is not None:
                        self.on_step_record(self.engine.last_step)
                    self._dispatch(outputs)
                self.stats = self.engine.stats()
        except Exception as e:
            # A failure that one request's outcome cannot contain (ranks out of step, or a scheduler
            # bug): fail every request and report unhealthy, so routers stop sending work here.
            log.exception("engine step loop died")
            self.error = f"{type(e).__name__}: {e}"
            for rid, sink in list(self._sinks.items()):
                sink(RequestOutput(rid, [], "", True, "error", error=self.error))
            self._sinks.clear()
            self._fail_queued()
            if self.on_death is not None:
                self.on_death(self.error)

    def _fail_queued(self) -> None:
        """After the loop died: answer every command still queued, so no caller waits forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            done = getattr(cmd, "done", None)
            if done is not None and done.set_running_or_notify_cancel():
                done.set_exception(RuntimeError(f"engine is not running: {self.error}"))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            try:
                self._apply(cmd)
            except Exception:  # a bug in one command's handling is that caller's problem, not the loop's
                log.exception("engine command %s failed", type(cmd).__name__)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd) -> None:
        # A caller that gave up cancels its command's future; set_running_or_notify_cancel() skips such a
        # command and otherwise makes the future uncancellable, so setting its result cannot raise
        # InvalidStateError here (which would end this thread and with it the engine).
        if isinstance(cmd, _Add):
            if not cmd.done.set_running_or_notify_cancel():
                return
            try:
                rid = self.engine.add_request(cmd.prompt_token_ids, cmd.params, cmd.request_id, cmd.request_type,
                                              cmd.disagg, cmd.resume)
            except Exception as e:  # RequestError is a 400; anything else a 500 for this request alone
                if not isinstance(e, RequestError):
                    log.exception("adding a request failed")
                cmd.done.set_exception(e)
                return
            self._sinks[rid] = cmd.sink
            self._open[rid] = num_answers(cmd.request_type, cmd.params.n)
            cmd.done.set_result(rid)
        elif isinstance(cmd, _Abort):
            rid = cmd.request_id if cmd.add is None else _added_id(cmd.add)
            if rid is None:
                return
            self.engine.abort(rid)
            self._sinks.pop(rid, None)
            self._open.pop(rid, None)
            self.engine.take_abort_output(rid)
        elif isinstance(cmd, _Call):
            if not cmd.done.set_running_or_notify_cancel():
                return
            try:
                cmd.done.set_result(cmd.fn(self.engine))
            except Exception as e:
                cmd.done.set_exception(e)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            rid = out.request_id
            self._open[rid] -= out.finished
            if not sink(out):
                log.warning("request %s: its caller's event loop is gone; aborting it", rid)
                del self._sinks[rid]
                if self._open.pop(rid):
                    self.engine.abort(rid)
                    self.engine.take_abort_output(rid)
                continue
            if not self._open[rid]:  # every choice finished
                del self._sinks[rid], self._open[rid]
        if self.on_step is not None and outputs:
            self.on_step(outputs)


def _added_id(add: _Add) -> str | None:
    """The id `add` created, or None if it was cancelled, refused or not applied yet."""
    done = add.done
    if not done.done() or done.cancelled() or done.exception(timeout=0) is not None:
        return None
    return done.result()
