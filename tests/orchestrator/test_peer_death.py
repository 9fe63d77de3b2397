"""Instances leaving a cluster under load. A context instance killed with -9 while it holds a request's
KV, or before it prefilled it: the orchestrator sends the request again, to the surviving instance, and
the client, whose response had not started, gets its answer (200), equal to the aggregated greedy
output, under either schedule style. Sent SIGTERM: it drains, and no request fails. A generation
instance killed with -9 before its answer began (a non-streaming one): the request runs again, and the
client gets its answer. Killed mid-stream: the stream moves to the surviving instance, which goes on
from the tokens sent (the client's text equals the aggregated greedy text); with migrate_streams off, the
client gets an error event and [DONE], and the next request is answered by the surviving instance."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
import time

import httpx
import pytest
from harness import MODEL_NAME, AppThread, Occupied, start_each, wait_healthy

from pdserve.orchestrator.app import build_app
from pdserve.orchestrator.config import DisaggConfig
from pdserve.testing import make_tiny_model

pytestmark = pytest.mark.faults
PROMPT = list(range(100, 140))
TRANSCEIVER = {"backend": "shm", "rank_info_timeout_s": 2.0, "kv_transfer_timeout_ms": 4000}


# A decode of LONG_TOKENS takes about 2.5 s on the development machine (1 ms a token), so a kill after the
# first chunks lands mid-stream. The session's tiny model stops at 512 positions (0.5 s of decode).
LONG_TOKENS = 3000
LONG_WORKER = {"max_model_len": 4096, "num_kv_blocks": 512, "cache_transceiver_config": TRANSCEIVER}


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("long-tiny") / "tiny", num_layers=2, num_heads=4, num_kv_heads=2,
                           max_position_embeddings=4096)


def _holds_kv(worker) -> bool:
    return worker.metric("pdserve_kv_cache_blocks_free") < worker.metric("pdserve_kv_cache_blocks_total")


@contextlib.contextmanager
def _workers(model_dir, workdir, *extras: dict, **common):
    """One worker per entry of `extras` (its own config keys beside `common`), killed on the way out."""
    ws = start_each(model_dir, workdir, [{"cache_transceiver_config": TRANSCEIVER, "kv_events_port": 0,
                                          **common, **extra} for extra in extras])
    try:
        yield ws
    finally:
        for w in ws:
            w.stop()


def _aggregated(worker, body: dict) -> str:
    """The worker's own (aggregated) answer: what the cluster must give back."""
    return httpx.post(worker.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]


def _kill_then_join(worker, sender: threading.Thread, timeout: float = 60) -> float:
    """SIGKILL `worker`, wait for the client thread `sender` to get its answer; seconds from the kill."""
    killed = time.monotonic()
    worker.stop()  # SIGKILL
    sender.join(timeout)
    return time.monotonic() - killed


def _styled(ctxs, gens, style: str) -> DisaggConfig:
    """An orchestrator over `ctxs` and `gens` serving in `style`: a schedule style, or aggregated (no
    context instance); one retry, no health probe during the test."""
    context = {"urls": [c.url for c in ctxs], "minimal_instances": len(ctxs)}
    return DisaggConfig(context_servers=context, generation_servers={"urls": [g.url for g in gens]},
                        max_retries=1, health_check_interval=60,
                        schedule_style="context_first" if style == "aggregated" else style)


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.01)


@pytest.mark.parametrize("schedule_style", ["context_first", "generation_first"])
def test_a_context_instance_killed_holding_the_kv_is_replaced(tiny_model_dir, tmp_path_factory, schedule_style):
    """The busy generation instance pulls the KV seconds after the prefill (generation_first: its
    request, sent with the context one, waits in its queue), so the doomed instance holds it when it
    is killed. The pull fails; the orchestrator sends both halves again, to the survivor."""
    # two context instances, one busy generation instance
    with _workers(tiny_model_dir, tmp_path_factory.mktemp("death"), {}, {}, {"max_num_seqs": 1}) as ws:
        doomed, survivor, gen = ws
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        expected = _aggregated(gen, body)
        cfg = DisaggConfig(context_servers={"urls": [doomed.url, survivor.url]},
                           generation_servers={"urls": [gen.url]}, max_retries=1, health_check_interval=60,
                           schedule_style=schedule_style)
        with AppThread(build_app(cfg)) as orch, Occupied(gen, n=16):
            wait_healthy(orch.url)
            with httpx.Client(base_url=orch.url, timeout=60) as client:
                pending = client.build_request("POST", "/v1/completions", json=body)
                response = {}

                def send():
                    response["r"] = client.send(pending)

                sender = threading.Thread(target=send)
                sender.start()
                # Round robin sent it to the doomed instance first: wait for its prefill, then kill it.
                deadline = time.monotonic() + 10
                while not _holds_kv(doomed) and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert time.monotonic() < deadline, "the doomed instance never held the request's KV"
                answered = _kill_then_join(doomed, sender)
        r = response["r"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        assert not _holds_kv(survivor)
        print(f"{schedule_style}: answered {answered:.2f} s after the kill")


@pytest.mark.parametrize("schedule_style", ["context_first", "generation_first"])
def test_a_context_instance_killed_while_prefilling_is_replaced(tiny_model_dir, tmp_path_factory, schedule_style):
    """The doomed context instance is busy (max_num_seqs 1, a queue of long requests), so the request's
    context half is still waiting there when it is killed: its connection drops (generation_first: while
    the generation half waits for the KV). The orchestrator sends the request again, to the survivor."""
    # a busy context instance, another, a generation instance
    with _workers(tiny_model_dir, tmp_path_factory.mktemp("death-prefill"), {"max_num_seqs": 1}, {}, {}) as ws:
        doomed, survivor, gen = ws
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        expected = _aggregated(gen, body)
        cfg = DisaggConfig(context_servers={"urls": [doomed.url, survivor.url]},
                           generation_servers={"urls": [gen.url]}, max_retries=1, health_check_interval=60,
                           schedule_style=schedule_style)
        with AppThread(build_app(cfg)) as orch, Occupied(doomed, n=16), \
                httpx.Client(base_url=orch.url, timeout=60) as client:
            wait_healthy(orch.url)
            response = {}
            sender = threading.Thread(target=lambda: response.update(r=client.post("/v1/completions", json=body)))
            sender.start()
            time.sleep(0.5)  # round robin sent it to the doomed instance first, where it waits behind the queue
            assert doomed.metric("pdserve_num_requests_waiting") >= 2, "the doomed instance's queue ran dry"
            answered = _kill_then_join(doomed, sender)
        r = response["r"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        _wait(lambda: not _holds_kv(survivor) and not _holds_kv(gen), 5, "both instances free the KV")
        print(f"{schedule_style}: answered {answered:.2f} s after the kill")


def test_sigterm_drains_a_context_instance_under_load(tiny_model_dir, tmp_path_factory):
    """SIGTERM to one of two context instances while it holds KV the (busy) generation instance has not
    pulled yet, with requests flowing: it answers 503 draining at once (the orchestrator routes
    elsewhere), lets the pulls finish, then exits 0. Not one request fails."""
    with _workers(tiny_model_dir, tmp_path_factory.mktemp("drain"), {}, {}, {"max_num_seqs": 1},
                  drain_timeout_s=30) as ws:
        draining, other, gen = ws
        prompts = [PROMPT[i:] + PROMPT[:i] for i in range(6)]
        body = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        expected = [_aggregated(gen, {**body, "prompt": p}) for p in prompts]
        cfg = DisaggConfig(context_servers={"urls": [draining.url, other.url]},
                           generation_servers={"urls": [gen.url]}, max_retries=1, health_check_interval=60)
        results: list[tuple[int, str]] = []

        def load(n: int) -> None:
            with httpx.Client(base_url=orch.url, timeout=60) as client:
                for i in range(n):
                    r = client.post("/v1/completions", json={**body, "prompt": prompts[i % len(prompts)]})
                    ok = r.status_code == 200 and r.json()["choices"][0]["text"] == expected[i % len(prompts)]
                    results.append((r.status_code, "right" if ok else r.text))

        with AppThread(build_app(cfg)) as orch, Occupied(gen, n=16):
            wait_healthy(orch.url)
            threads = [threading.Thread(target=load, args=(6,)) for _ in range(4)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 10
            while not _holds_kv(draining) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _holds_kv(draining), "the instance to drain never held KV"
            draining.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            health = httpx.get(draining.url + "/health", timeout=5)
            assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
            assert draining.proc.wait(timeout=40) == 0
            for t in threads:
                t.join(90)
        assert len(results) == 24
        assert [r for r in results if r != (200, "right")] == []


def test_a_generation_instance_killed_mid_stream_without_migration(long_model_dir, tmp_path_factory):
    """migrate_streams off. kill -9 of the generation instance that is streaming a long answer, after a few
    chunks: the client gets an OpenAI-style error event naming the generation server, then `data: [DONE]` (what a worker
    sends after an error, and what clients that read to [DONE] wait for), and the stream closes. The
    orchestrator stays up, the context instance holds no KV, and the next requests are answered by the
    other generation instance. The dead one is still in routing (no /health probe ran), so one of the two
    is sent there first: its refused connection takes it out and the request goes to the survivor. Then
    the survivor is killed mid-decode of a non-streaming request: no generation instance is left to run it
    again, so a 503 naming the failure, not a hang or a 500."""
    # one context instance, two generation instances
    with _workers(long_model_dir, tmp_path_factory.mktemp("gen-death"), {}, {}, {}, **LONG_WORKER) as ws:
        ctx, gens = ws[0], ws[1:]
        short = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        expected = _aggregated(gens[0], short)
        long = {**short, "max_tokens": LONG_TOKENS}
        cfg = DisaggConfig(context_servers={"urls": [ctx.url]}, generation_servers={"urls": [g.url for g in gens]},
                           max_retries=1, health_check_interval=60, migrate_streams=False)
        with AppThread(build_app(cfg)) as orch, httpx.Client(base_url=orch.url, timeout=30) as client:
            wait_healthy(orch.url)
            events: list[str] = []
            with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                assert r.status_code == 200
                lines = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
                events += [next(lines) for _ in range(10)]
                doomed = next(g for g in gens if _holds_kv(g))  # the one decoding it
                killed = time.monotonic()
                doomed.stop()  # SIGKILL
                for event in lines:  # bounded: the stream has at most LONG_TOKENS + 2 events
                    if event.startswith('{"error"'):
                        to_error = time.monotonic() - killed
                    events.append(event)
                closed = time.monotonic() - killed
            assert len(events) < LONG_TOKENS, "the stream ran to its end: the kill was not mid-stream"
            assert events[-1] == "[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert f"generation server {doomed.url} failed" in error["message"], error
            assert error["code"] == "worker_failed" and error["type"] == "bad_gateway"
            assert [e for e in events[:-2] if not e.startswith('{"id"')] == []  # whole token chunks
            assert closed < 5, f"the stream closed {closed:.2f} s after the kill"
            _wait(lambda: not _holds_kv(ctx), 5, "the context instance frees its KV")
            assert client.get("/health").status_code == 200

            answers = []
            for _ in range(2):
                answers.append(client.post("/v1/completions", json=short))
                if len(answers) == 1:
                    recovered = time.monotonic() - killed
            assert [(r.status_code, r.json()["choices"][0]["text"]) for r in answers] == [(200, expected)] * 2
            print(f"generation instance killed mid-stream: error event {to_error:.3f} s after the kill, stream "
                  f"closed at {closed:.3f} s, first good answer (from the survivor) at {recovered:.3f} s")

            survivor = next(g for g in gens if g is not doomed)
            answer = {}
            sender = threading.Thread(target=lambda: answer.update(r=client.post("/v1/completions", json=long)))
            sender.start()
            _wait(lambda: _holds_kv(survivor), 10, "the survivor takes the non-streaming request")
            time.sleep(0.2)  # mid-decode
            answered = _kill_then_join(survivor, sender, 30)
            r = answer["r"]
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "no_ready_instance" and f"{survivor.url}: generation server {survivor.url} " \
                "failed mid-request" in error["message"], error
            _wait(lambda: not _holds_kv(ctx), 5, "the context instance frees its KV")
            assert client.get("/v1/models").status_code == 200  # still up
            print(f"generation instance killed mid-decode of a non-streaming request: 503 {answered:.3f} s after")


@pytest.mark.parametrize("style", ["context_first", "generation_first", "aggregated"])
def test_a_generation_instance_killed_before_its_answer_began_is_replaced(long_model_dir, tmp_path_factory, style):
    """kill -9 of the generation instance decoding a non-streaming request: nothing has reached the
    client, so the orchestrator runs the request again (disaggregated: both halves, under a fresh id;
    aggregated: on the other instance as it is), and the client gets a 200 equal to the aggregated
    greedy answer. The dead instance leaves routing at once, and no instance holds KV afterwards."""
    # (a context instance unless aggregated) and two generation instances
    roles = ([] if style == "aggregated" else ["context"]) + ["generation"] * 2
    with _workers(long_model_dir, tmp_path_factory.mktemp("gen-loss"), *({} for _ in roles), **LONG_WORKER) as ws:
        ctxs, gens = ws[:-2], ws[-2:]
        body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0,
                "ignore_eos": True}
        expected = _aggregated(gens[0], body)
        with AppThread(build_app(_styled(ctxs, gens, style))) as orch, \
                httpx.Client(base_url=orch.url, timeout=60) as client:
            wait_healthy(orch.url)
            answer = {}
            sender = threading.Thread(target=lambda: answer.update(r=client.post("/v1/completions", json=body)))
            sender.start()
            _wait(lambda: any(_holds_kv(g) for g in gens), 10, "a generation instance takes the request")
            doomed = next(g for g in gens if _holds_kv(g))
            survivor = next(g for g in gens if g is not doomed)
            time.sleep(0.2)  # mid-decode
            assert answer == {}, "the request ended before the kill"
            answered = _kill_then_join(doomed, sender)
            r = answer["r"]
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected
            members = client.get("/cluster_info").json()["generation_servers"]["instances"]
            assert {m["url"]: m["state"] for m in members}[doomed.url] != "ready", members
            retries = re.search(r'^pdserve_orchestrator_retries_total{role="generation"} (\S+)$',
                                client.get("/metrics").text, re.M)
            assert float(retries.group(1)) == 1
            _wait(lambda: not any(_holds_kv(w) for w in [*ctxs, survivor]), 5, "every instance frees the KV")
        print(f"{style}: a generation instance killed mid-decode, answered {answered:.2f} s after the kill")


def _chat(worker, body: dict) -> str:
    return httpx.post(worker.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"][
        "content"]


@pytest.mark.parametrize("style,api", [("context_first", "completions"), ("generation_first", "chat"),
                                       ("aggregated", "completions")])
def test_a_stream_whose_generation_instance_is_killed_moves_to_another(long_model_dir, tmp_path_factory, style, api):
    """kill -9 of the generation instance streaming a long greedy answer, after a few chunks: the stream
    goes on from the surviving instance, which recomputes the prompt and the tokens sent so far and
    continues. The client sees one unbroken stream (one id, no second role chunk, no error event) whose
    text equals the aggregated greedy text, with the usage of the whole request; no instance holds KV
    afterwards."""
    roles = ([] if style == "aggregated" else ["context"]) + ["generation"] * 2
    with _workers(long_model_dir, tmp_path_factory.mktemp("gen-move"), *({} for _ in roles), **LONG_WORKER) as ws:
        ctxs, gens = ws[:-2], ws[-2:]
        common = {"model": MODEL_NAME, "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}
        if api == "chat":
            body, path = {**common, "messages": [{"role": "user", "content": "Tell me a long story."}]}, \
                "/v1/chat/completions"
            expected = _chat(gens[0], body)
        else:
            body, path = {**common, "prompt": PROMPT}, "/v1/completions"
            expected = _aggregated(gens[0], body)
        with AppThread(build_app(_styled(ctxs, gens, style))) as orch, \
                httpx.Client(base_url=orch.url, timeout=60) as client:
            wait_healthy(orch.url)
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            with client.stream("POST", path, json=stream) as r:
                assert r.status_code == 200
                lines = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
                events = [next(lines) for _ in range(10)]
                doomed = next(g for g in gens if _holds_kv(g))  # the one decoding it
                killed = time.monotonic()
                doomed.stop()  # SIGKILL
                arrivals = [killed]
                for event in lines:  # bounded: at most LONG_TOKENS + 3 events
                    events.append(event)
                    arrivals.append(time.monotonic())
                closed = time.monotonic() - killed
            pause = max(b - a for a, b in zip(arrivals, arrivals[1:]))
            assert events[-1] == "[DONE]" and not any(e.startswith('{"error"') for e in events), events[-3:]
            chunks = [json.loads(e) for e in events[:-1]]
            rows = [c["choices"][0] for c in chunks if c["choices"]]
            text = "".join((row.get("delta") or {}).get("content") or row.get("text") or "" for row in rows)
            assert text == expected
            assert len({c["id"] for c in chunks}) == 1
            assert all("token_ids" not in row for row in rows)  # the orchestrator's, taken out again
            assert sum(1 for row in rows if (row.get("delta") or {}).get("role")) == (api == "chat")
            assert rows[-1]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == LONG_TOKENS
            moves = re.search(r'^pdserve_orchestrator_stream_moves_total (\S+)$', client.get("/metrics").text, re.M)
            assert float(moves.group(1)) == 1
            survivor = next(g for g in gens if g is not doomed)
            _wait(lambda: not any(_holds_kv(w) for w in [*ctxs, survivor]), 5, "every instance frees the KV")
        print(f"{style} {api}: a stream moved after its instance was killed; its longest pause from the kill on "
              f"{pause:.3f} s, ended {closed:.2f} s after the kill")
