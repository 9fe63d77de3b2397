"""Request grammars tried first where a native crash cannot take the server down.

llguidance compiles in native code. Some grammars a client may send crash it: a chain of 5,000 rules
(`r0: r1`, `r1: r2`, ...) recurses past an 8 MiB thread stack and the process dies of SIGSEGV, whatever
Python limits are set. So an instance never compiles a grammar in its own process first:

    Grammars.compile(spec) ──digest known good?──> compile in-process (on a 32 MiB stack)
          │ unknown                          known bad? ──> GuidedError at once (the first refusal's text)
          ▼
    GrammarSandbox.check(spec) ──frame──> sandbox child (`python -m pdserve.engine.grammar_compiler`): holds
                               <──verdict──  the tokenizer view, forks one compiler per grammar, which
                                             compiles on an 8 MiB stack under RLIMIT_AS and probes a few tokens

A compiler that dies (a signal), runs out of its memory or outlasts the compile timeout is a refusal (a 400
naming the request's field); the sandbox child lives on, so the next grammar waits for no start-up (a fork,
~5-20 ms, not the ~0.7 s of a new child that builds its tokenizer view). A verdict is remembered by the spec's
digest, so a repeat of a good grammar costs a dict lookup and a repeat of a bad one costs nothing at all.

The compiler runs on a quarter of the stack the server's compiles get: the recursion depth is a function of
the grammar alone, so what fits in the compiler fits four times over in the server. The compiler also takes
the first few tokens the grammar allows (the lowest id each time): a grammar too wide for llguidance's parser
(more than `max_items_in_row` alternatives live at once: a `choice` of 20,000 strings, an object of 5,000
optional properties) usually fails there, right after its opening token, and is refused before any compute.

Wire: one frame each way per check, a 4-byte big-endian length and msgpack. The first frame to a child holds
the tokenizer (its JSON, the vocabulary size, EOS ids). A child exits when its stdin closes, so children never
outlive their server. The child is single-threaded when it forks (llguidance starts no threads of its own).
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict

import msgpack

from pdserve.engine.sampling_params import GuidedSpec

log = logging.getLogger(__name__)

CHILD_STACK_BYTES = 8 * 1024 * 1024  # the compiler's thread (the server's: guided.COMPILE_STACK_BYTES)
CHILD_MEMORY_BYTES = 2 * 1024 * 1024 * 1024  # address space a compiler may add past its fork (RLIMIT_AS)
REMEMBERED = 4096  # verdicts kept per kind (good, bad), least recently used dropped first
_HEADER = struct.Struct(">I")
_MAX_FRAME = 64 * 1024 * 1024  # a tokenizer's JSON is the largest frame (Qwen's: ~11 MB)
_GRACE_S = 5.0  # past the compile timeout, how long the server waits for the child that enforces it


def ended(what: str, code: int) -> str:
    """How a process ended, as the end of a sentence about a grammar: `code` is a returncode (-N: signal N)."""
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (out of its memory, or another fault)" if -code == signal.SIGABRT else ""
        return f"crashed {what} ({name}{hint})"
    return f"stopped {what} (exit status {code})"


def digest(spec: GuidedSpec) -> bytes:
    return hashlib.blake2b(f"{spec.kind}\0{spec.text}".encode(errors="surrogatepass"), digest_size=16).digest()


def write_frame(stream, obj) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """`n` bytes from `fd`; None at EOF. TimeoutError past `deadline` (time.monotonic())."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, deadline: float | None = None):
    header = _read_exact(fd, _HEADER.size, deadline)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > _MAX_FRAME:
        raise ValueError(f"a grammar sandbox frame of {size} bytes (at most {_MAX_FRAME})")
    body = _read_exact(fd, size, deadline)
    return None if body is None else msgpack.unpackb(body, raw=False)


class SandboxBusy(Exception):
    """No sandbox child came free within the compile timeout: every one is compiling another grammar."""


class _CompilerLost(Exception):
    """The compiler forked for one grammar died or outlasted the timeout: the grammar's fault."""


class _ChildLost(Exception):
    """A sandbox child itself died or stopped answering."""


class _Child:
    """One sandbox process (it forks a compiler per grammar); used by one thread at a time."""

    def __init__(self, init: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.grammar_compiler"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        write_frame(self.proc.stdin, init)

    def ask(self, spec: GuidedSpec, timeout_s: float) -> str | None:
        """The verdict on `spec`: None (usable) or why not. _CompilerLost(why) when the compiler forked for it
        was lost (a signal, the timeout); _ChildLost(why) when this child died or stopped answering (it is then
        gone)."""
        try:
            write_frame(self.proc.stdin, {"kind": spec.kind, "text": spec.text, "param": spec.param,
                                           "timeout_s": timeout_s})
            answer = read_frame(self.proc.stdout.fileno(), time.monotonic() + timeout_s + _GRACE_S)
        except TimeoutError:
            self.close()
            raise _ChildLost("left the grammar sandbox unresponsive") from None
        except (OSError, ValueError):  # a pipe closed under us: the child died
            answer = None
        if answer is None:
            raise _ChildLost(self._death())
        if answer["lost"] is not None:
            raise _CompilerLost(answer["lost"])
        return answer["error"]

    def _death(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.close()
            return "left the grammar sandbox unresponsive"
        return ended("the grammar sandbox", code)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class GrammarSandbox:
    """Up to `processes` compiler children (started on first need), and the verdicts they gave. Thread-safe."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], timeout_s: float,
                 processes: int = 2):
        self._init = {"tokenizer_json": tokenizer_json, "vocab_size": vocab_size, "eos": list(eos_token_ids)}
        self.timeout_s = timeout_s
        self._max = processes
        self._idle: list[_Child] = []
        self._started = 0  # children alive or in use
        self._cond = threading.Condition()
        self._good: OrderedDict[bytes, None] = OrderedDict()
        self._bad: OrderedDict[bytes, str] = OrderedDict()
        self.crashes = 0  # compilers lost to a grammar (a signal or the timeout)
        self._closed = False

    def check(self, spec: GuidedSpec, what: str) -> str | None:
        """None when `spec` compiled in the sandbox, else why it cannot be used (a sentence about `what`, e.g.
        "the grammar crashed the grammar compiler (SIGSEGV)"). Blocks while the children are busy."""
        try:
            spec.text.encode()
        except UnicodeEncodeError:  # no compiler takes it, and the wire to the child would not
            return f"the {what} holds a lone UTF-16 surrogate: send it as valid Unicode"
        key = digest(spec)
        with self._cond:
            if key in self._good:
                self._good.move_to_end(key)
                return None
            if key in self._bad:
                self._bad.move_to_end(key)
                return self._bad[key]
        try:
            problem = self._ask(spec)
        except _CompilerLost as e:
            problem = f"the {what} {e}; it is refused: simplify it (fewer nested, chained or alternative rules)"
            log.warning("a request's %s %s (%d characters, digest %s); refused, and refused at once if sent again",
                        what, e, len(spec.text), key.hex())
            with self._cond:
                self.crashes += 1
        with self._cond:
            table = self._good if problem is None else self._bad
            table[key] = problem
            while len(table) > REMEMBERED:
                table.popitem(last=False)
        return problem

    def _ask(self, spec: GuidedSpec) -> str | None:
        """A child's verdict. A child that dies itself (not its compiler: the OOM killer, an operator) is
        replaced and asked again, once; a second loss is the grammar's."""
        deadline = time.monotonic() + self.timeout_s
        for attempt in (1, 2):
            child = self._take(deadline)
            try:
                return child.ask(spec, self.timeout_s)
            except _ChildLost as e:
                if attempt == 2:
                    raise _CompilerLost(str(e)) from None
                log.warning("the grammar sandbox child %d %s; a new one is asked", child.proc.pid, e)
            finally:
                self._give(child)

    def _take(self, deadline: float) -> _Child:
        """An idle child, a new one while fewer than `processes` run, else the first to come free before
        `deadline` (SandboxBusy past it)."""
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the grammar sandbox is closed")
                while self._idle:
                    child = self._idle.pop()
                    if child.alive:
                        return child
                    child.close()
                    self._started -= 1
                if self._started < self._max:
                    self._started += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SandboxBusy(f"every grammar compiler of this instance ({self._max}) stayed busy for "
                                      f"{self.timeout_s:g} s")
                self._cond.wait(left)
        try:
            return _Child(self._init)
        except BaseException:
            with self._cond:
                self._started -= 1
                self._cond.notify()
            raise

    def _give(self, child: _Child) -> None:
        with self._cond:
            if child.alive and not self._closed:
                self._idle.append(child)
            else:
                child.close()
                self._started -= 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for child in idle:
            child.close()


_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide: set, start, set back


def on_stack(stack_bytes: int, fn, *args):
    """fn(*args) in a new thread whose stack is `stack_bytes` (the native compiler recurses on it); its
    exception, if it raises one, is raised here."""
    out: list = []

    def run():
        try:
            out.append((True, fn(*args)))
        except BaseException as e:  # handed to the caller's thread
            out.append((False, e))

    with _STACK_SIZE_LOCK:
        old = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=run, name="grammar-compile")
            thread.start()
        finally:
            threading.stack_size(old)
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value
