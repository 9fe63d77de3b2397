"""Grammars a client sends are compiled first in a sandbox child (engine/grammar_sandbox.py): a grammar that
crashes llguidance's native compiler is a 400 naming its field, and the `pdserve serve` process (a real one
here, so that a crash would kill it and not the test run) keeps serving."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import scrape

from pdserve.engine.grammar_sandbox import GrammarSandbox
from pdserve.engine.sampling_params import GuidedSpec
from pdserve.host import free_port
from pdserve.testing.servers import wait_for_health
from pdserve.tokenizer import Tokenizer

GRAMMAR = "structured_outputs.grammar"
PREFILLED = 'pdserve_engine_step_tokens_total{kind="prefill"}'


def lark_chain(n: int) -> str:
    """The issue's grammar: rule i is rule i + 1, 5,000 deep overflows the compiler's stack (63 KB)."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= a0\n" + "".join(f"a{i} ::= a{i + 1}\n" for i in range(n)) + f'a{n} ::= "x"\n'


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "serve",
                             str(tiny_model_dir), "--port", str(port), "--kv-cache-memory-gb", "0.0625"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, proc, proc.stdout.read)
        with httpx.Client(base_url=url, timeout=60) as http:
            http.model = http.get("/v1/models").json()["data"][0]["id"]
            http.proc = proc
            yield http
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _complete(http, **extra) -> httpx.Response:
    return http.post("/v1/completions", json={"model": http.model, "prompt": "The quick", "max_tokens": 3,
                                              "temperature": 0, **extra})


def _alive_and_serving(http) -> None:
    assert http.proc.poll() is None, f"the server exited with {http.proc.returncode}"
    r = _complete(http)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_a_grammar_that_crashes_the_compiler_is_a_400_and_the_server_serves_on(served):
    slowest = 0.0
    stop = threading.Event()

    def watch_health():  # /health while the crashing grammars are sent
        nonlocal slowest
        with httpx.Client(base_url=str(served.base_url), timeout=10) as h:
            while not stop.is_set():
                t = time.perf_counter()
                assert h.get("/health").status_code == 200
                slowest = max(slowest, time.perf_counter() - t)
                time.sleep(0.02)

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    try:
        for text in (lark_chain(5000), gbnf_chain(5000)):
            r = _complete(served, structured_outputs={"grammar": text})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == GRAMMAR and "crashed the grammar compiler (SIGSEGV)" in error["message"], error
            # the same grammar again is refused from memory: no child is started or lost for it
            t = time.perf_counter()
            again = _complete(served, structured_outputs={"grammar": text})
            assert again.status_code == 400 and again.json()["error"] == error
            assert time.perf_counter() - t < 0.5
    finally:
        stop.set()
        watcher.join()
    assert slowest < 0.5, f"/health took {slowest:.2f} s"
    _alive_and_serving(served)
    # a deep chain that compiles (in the child, then here) is served
    r = _complete(served, structured_outputs={"grammar": lark_chain(300)})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "x", r.text


@pytest.mark.parametrize("field, value, param", [
    ("structured_outputs", {"choice": [f"c{i}" for i in range(20000)]}, "structured_outputs.choice"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "wide", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2500)}}}},
     "response_format.json_schema.schema"),
], ids=["choice-20k", "optional-properties-2500"])
def test_a_grammar_too_wide_for_the_parser_is_a_400_before_any_compute(served, field, value, param):
    computed = scrape(served).get(PREFILLED, 0.0)
    if field == "response_format":
        r = served.post("/v1/chat/completions", json={"model": served.model, "max_tokens": 4, field: value,
                                                      "messages": [{"role": "user", "content": "hi"}]})
    else:
        r = _complete(served, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "Current row has" in r.json()["error"]["message"], r.text
    assert scrape(served).get(PREFILLED, 0.0) == computed
    _alive_and_serving(served)


def test_a_grammar_that_fails_past_the_probe_is_a_400_not_a_500(served):
    """The sandbox probes only the first tokens; a grammar that opens a row too wide for llguidance later fails
    on its way, and that is the grammar's fault: a 400 (it was a 500 'no token is left to sample')."""
    lead = " ".join(['("a" | "b")'] * 12)  # a choice each token, so nothing is forced past the probe
    text = f"start: {lead} ({' | '.join(json.dumps(f'c{i}') for i in range(3000))})"
    r = _complete(served, structured_outputs={"grammar": text}, max_tokens=64)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "grammar_failed" and "Current row has" in error["message"], error
    assert GRAMMAR in error["message"]
    _alive_and_serving(served)


_RULE = st.integers(0, 6000) | st.sampled_from([3000, 5000])  # past the child's stack: crashes


@st.composite
def grammars(draw):
    """Lark texts of the shapes that stress the compiler: rule chains, nested groups, wide alternations."""
    shape = draw(st.sampled_from(["chain", "nest", "wide", "mixed"]))
    n = draw(_RULE)
    if shape == "chain":
        return lark_chain(n)
    if shape == "nest":
        depth = draw(st.integers(1, 3000))
        return "start: " + "(" * depth + '"a"' + ")" * depth
    if shape == "wide":
        return "start: " + " | ".join(json.dumps(f"w{i}") for i in range(n + 1))
    return lark_chain(n // 3) .replace(f'r{n // 3}: "x"', f"r{n // 3}: " + " | ".join(
        f'"{i}" r{n // 3 + 1}?' for i in range(draw(st.integers(1, 300)))) + f'\nr{n // 3 + 1}: "y"')


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=grammars())
def test_any_grammar_is_a_200_or_a_400_and_the_server_lives(served, text):
    r = _complete(served, structured_outputs={"grammar": text}, max_tokens=2)
    assert r.status_code in (200, 400), r.text
    assert served.proc.poll() is None
    t = time.perf_counter()
    assert served.get("/health").status_code == 200 and time.perf_counter() - t < 0.5


def test_the_sandbox_outlives_its_compilers_and_replaces_a_lost_child(tiny_model_dir):
    tok = Tokenizer.from_dir(tiny_model_dir)
    sandbox = GrammarSandbox(tok.backend.to_str(), tok.vocab_size, [0], timeout_s=10)
    try:
        crash = GuidedSpec("grammar", lark_chain(5000), GRAMMAR)
        assert "crashed the grammar compiler (SIGSEGV)" in sandbox.check(crash, "grammar")
        child = sandbox._idle[0]
        assert child.alive and sandbox.crashes == 1  # the compiler forked for the grammar died, not the child
        assert sandbox.check(GuidedSpec("regex", "[0-9]+", "p"), "regex") is None
        assert sandbox._idle == [child]
        child.proc.kill()  # a child lost anyway (OOM killer, an operator) is replaced on the next check
        child.proc.wait()
        assert sandbox.check(GuidedSpec("regex", "[a-z]+", "p"), "regex") is None
        assert sandbox._idle and sandbox._idle[0] is not child and sandbox._idle[0].alive
        assert "not JSON" in sandbox.check(GuidedSpec("json", "{", "p"), "JSON schema")
        assert "lone UTF-16 surrogate" in sandbox.check(GuidedSpec("regex", "a\ud800", "p"), "regex")
    finally:
        sandbox.close()
    assert not sandbox._idle and child.proc.poll() is not None


def test_a_grammar_that_finds_every_compiler_busy_is_the_services_503(tiny_model_dir):
    """Busy compilers are the instance's state, not the grammar's fault: no verdict is remembered for it."""
    from pdserve.engine.guided import CompilersBusy, Grammars

    tok = Tokenizer.from_dir(tiny_model_dir)
    grammars = Grammars(tok.backend.to_str(), tok.vocab_size, [0], timeout_s=0.3)
    sandbox = grammars.sandbox
    spec = GuidedSpec("regex", "[0-9]+", "structured_outputs.regex")
    try:
        held = [sandbox._take(time.monotonic() + 5) for _ in range(sandbox._max)]  # every child compiling
        with pytest.raises(CompilersBusy, match="stayed busy for 0.3 s") as e:
            grammars.compile(spec)
        assert e.value.param == "structured_outputs.regex"
        for child in held:
            sandbox._give(child)
        grammars.compile(spec)  # served once a compiler is free
    finally:
        grammars.close()
