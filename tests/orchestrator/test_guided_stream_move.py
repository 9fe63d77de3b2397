"""A guided stream survives its generation instance's kill -9 (issue 44): a greedy stream under a regex moves to
another generation instance after a few chunks; that instance starts its matcher from the `resume` tokens and
goes on, so the client's text equals the uninterrupted text, every character of it one the regex allows. Through
the session's plain workers (served whole: the cheap one), and through a context instance and two generation
instances (context_first; slow: three instances of its own)."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from harness import MODEL_NAME, AppThread, start_each, wait_healthy

from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.config import DisaggConfig
from pdserve.testing import make_tiny_model

pytestmark = pytest.mark.faults
TRANSCEIVER = {"backend": "shm", "rank_info_timeout_s": 2.0, "kv_transfer_timeout_ms": 4000}
PROMPT = list(range(100, 140))


def _regex(tokens: int) -> str:
    """Three-letter words, more than `tokens` tokens can hold (no token of the tiny vocabulary holds 8 characters
    of them): the stream runs to its length, long enough for a kill after its first chunks to land mid-stream.
    Where the next space goes depends on every character so far, so a matcher that did not start from the resume
    tokens would put it elsewhere."""
    return f"([a-z]{{3}} ){{{2 * tokens},}}"


WORDS = re.compile("([a-z]{3} )*[a-z]{0,3}")


def _stream_and_kill(orch_url: str, body: dict, doomed) -> list[str]:
    """Stream `body` through the orchestrator, SIGKILL the worker `doomed()` names after 10 events; every
    event's data."""
    with httpx.Client(base_url=orch_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
            events = [next(lines) for _ in range(10)]
            doomed().stop()  # SIGKILL
            events += list(lines)
        moves = re.search(r'^pdserve_orchestrator_stream_moves_total (\S+)$', client.get("/metrics").text, re.M)
        assert float(moves.group(1)) == 1
    return events


def _text(events: list[str]) -> str:
    assert events[-1] == "[DONE]" and not any(e.startswith('{"error"') for e in events), events[-3:]
    rows = [c["choices"][0] for c in map(json.loads, events[:-1]) if c["choices"]]
    assert rows[-1]["finish_reason"] == "length"
    return "".join(row["text"] for row in rows)


def test_a_guided_stream_moves_to_another_instance_and_keeps_its_grammar(tiny_model_dir, tmp_path):
    """Two plain workers of its own (the session's are shared, and one of these dies), served whole: the
    stream starts on the first in round-robin order, which is killed; the other goes on from the resume
    tokens. (It used the session's workers[2] before, and every later test that needs that worker alive
    failed: test_orchestrator's dead-worker test, in CI.)"""
    doomed, survivor = start_each(tiny_model_dir, tmp_path, [None, None])
    try:
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                "structured_outputs": {"regex": _regex(200)}}
        expected = httpx.post(survivor.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert WORDS.fullmatch(expected) and len(expected) > 200, expected
        cfg = DisaggConfig(context_servers={"urls": [], "minimal_instances": 0},
                           generation_servers={"urls": [doomed.url, survivor.url]}, max_retries=1,
                           health_check_interval=60)
        with AppThread(build_app(cfg)) as orch:
            wait_healthy(orch.url)
            assert _text(_stream_and_kill(orch.url, body, lambda: doomed)) == expected
    finally:
        for w in (doomed, survivor):
            w.stop()


def _holds_kv(worker) -> bool:
    return worker.metric("pdserve_kv_cache_blocks_free") < worker.metric("pdserve_kv_cache_blocks_total")


@pytest.mark.slow
def test_a_disaggregated_guided_stream_moves_and_keeps_its_grammar(tmp_path_factory):
    """context_first: the context instance samples the first token under the regex, a generation instance goes
    on from it and is killed; the other goes on from the resume tokens."""
    model = make_tiny_model(tmp_path_factory.mktemp("guided-move") / "tiny", num_layers=2, num_heads=4,
                            num_kv_heads=2, max_position_embeddings=1024)
    worker = {"cache_transceiver_config": TRANSCEIVER, "kv_events_port": 0, "max_model_len": 1024,
              "num_kv_blocks": 128}
    ws = start_each(model, tmp_path_factory.mktemp("guided-move-workers"), [worker] * 3)
    try:
        ctx, gens = ws[0], ws[1:]
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 700, "temperature": 0,
                "structured_outputs": {"regex": _regex(700)}}
        expected = httpx.post(gens[0].url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert WORDS.fullmatch(expected), expected
        cfg = DisaggConfig(context_servers={"urls": [ctx.url], "minimal_instances": 1},
                           generation_servers={"urls": [g.url for g in gens]}, max_retries=1,
                           health_check_interval=60, schedule_style="context_first")
        with AppThread(build_app(cfg)) as orch:
            wait_healthy(orch.url)
            events = _stream_and_kill(orch.url, body, lambda: next(g for g in gens if _holds_kv(g)))
            assert _text(events) == expected
            deadline = time.monotonic() + 5
            while any(_holds_kv(w) for w in ws if w.proc.poll() is None) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not any(_holds_kv(w) for w in ws if w.proc.poll() is None)
    finally:
        for w in ws:
            w.stop()
