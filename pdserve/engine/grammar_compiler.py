"""The sandbox child (`python -m pdserve.engine.grammar_compiler`, started by grammar_sandbox.GrammarSandbox):
it builds the instance's tokenizer view once, then for each grammar framed on its stdin forks a compiler that
compiles it on an 8 MiB stack under RLIMIT_AS and walks its first PROBE_TOKENS tokens, and frames the verdict
back on its stdout: the compiler's GuidedError text, or how the compiler was lost (a signal, the timeout)."""

from __future__ import annotations

import os
import signal
import sys
import time

from pdserve.engine.grammar_sandbox import (
    CHILD_MEMORY_BYTES,
    CHILD_STACK_BYTES,
    ended,
    on_stack,
    read_frame,
    write_frame,
)
from pdserve.engine.guided import WHAT, GuidedError, compile_matcher, first_line
from pdserve.engine.sampling_params import GuidedSpec

PROBE_TOKENS = 4  # tokens the compiler walks through each grammar after it compiles


def _verdict(spec: GuidedSpec, tokenizer) -> str | None:
    try:
        matcher = compile_matcher(spec, tokenizer)
        probe(matcher, spec)
    except GuidedError as e:
        return str(e)
    return None


def probe(matcher, spec: GuidedSpec) -> None:
    """Walk `matcher` (consumed) through up to PROBE_TOKENS tokens, the lowest id allowed each time:
    GuidedError when the grammar fails on the way (llguidance's row limit, right after an opening token)."""
    import numpy as np

    for _ in range(PROBE_TOKENS):
        if matcher.is_stopped():
            return
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
        if matcher.is_error():
            break
        nonzero = np.flatnonzero(words)
        if not len(nonzero):
            return
        word = int(nonzero[0])
        token = word * 32 + (int(words[word]) & -int(words[word])).bit_length() - 1
        if not matcher.consume_token(token):
            break
    else:
        return
    raise GuidedError(f"the {WHAT[spec.kind]} cannot be used: {first_line(matcher.get_error())}", spec.param)


def _limit_memory(extra_bytes: int) -> None:
    import resource

    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (used + extra_bytes, used + extra_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash here is expected: no core file


def _forked_verdict(spec: GuidedSpec, tokenizer, timeout_s: float) -> dict:
    """{"error": the verdict, "lost": None}, or {"error": None, "lost": why} when the compiler forked for `spec`
    died or outlasted `timeout_s` (it is killed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the compiler: one grammar, then exit; nothing of the sandbox child's state is touched
        try:
            os.close(r)
            _limit_memory(CHILD_MEMORY_BYTES)
            error = on_stack(CHILD_STACK_BYTES, _verdict, spec, tokenizer)
            with os.fdopen(w, "wb") as f:
                write_frame(f, {"error": error})
        finally:
            os._exit(0)
    os.close(w)
    lost = None
    try:
        answer = read_frame(r, time.monotonic() + timeout_s)
    except TimeoutError:
        os.kill(pid, signal.SIGKILL)
        answer, lost = None, f"took longer than {timeout_s:g} s to compile"
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    if answer is not None:
        return {"error": answer["error"], "lost": None}
    return {"error": None, "lost": lost or ended("the grammar compiler", -os.WTERMSIG(status)
                                                  if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))}


def main() -> None:
    import llguidance

    fd_in, out = sys.stdin.fileno(), sys.stdout.buffer
    init = read_frame(fd_in)
    if init is None:
        return
    tokenizer = llguidance.LLTokenizer(init["tokenizer_json"], n_vocab=init["vocab_size"], eos_token=init["eos"])
    # The first compile on a tokenizer view builds its lazy tables (~60 ms); built here, every fork has them.
    _verdict(GuidedSpec("regex", "[0-9]{1,3}", "warm-up"), tokenizer)
    while (req := read_frame(fd_in)) is not None:
        spec = GuidedSpec(req["kind"], req["text"], req["param"])
        write_frame(out, _forked_verdict(spec, tokenizer, req["timeout_s"]))


if __name__ == "__main__":
    main()
