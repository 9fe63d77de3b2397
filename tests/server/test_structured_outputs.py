"""Structured outputs through the HTTP API with the official openai client: response_format json_schema (a
pydantic model through `client.chat.completions.parse`) and json_object, vLLM's `structured_outputs` (json,
regex, choice, grammar) on /v1/chat/completions and /v1/completions, streamed and not, on the tiny model and on
SmolLM2; every bad schema, regex or grammar a 400 naming its field before any compute, with no KV leaked."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field
from server_harness import ServerThread, wait_kv_baseline

from pdserve.config import EngineConfig, WorkerConfig
from pdserve.server.app import build_app

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "An item, please"}]


class Item(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)
    ok: bool
    tag: str = Field(pattern=r"^[a-z]{1,6}$")


def test_parse_with_a_pydantic_model_on_the_tiny_model(client):
    for temperature in (0.0, 1.0):
        reply = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Item, max_tokens=60,
                                              temperature=temperature, seed=3)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Item), choice.message.content
        assert Item.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_regex_choice_and_grammar(http, client):
    r = http.post(COMPLETIONS, json={"model": "tiny", "prompt": "x", "max_tokens": 40, "temperature": 0,
                                     "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert r.json()["choices"][0]["finish_reason"] == "length" or isinstance(json.loads(text), dict), text
    assert text.startswith("{")
    asks = [({"regex": r"[0-9]{2}-[a-c]{2}"}, lambda t: len(t) == 5 and t[:2].isdigit() and t[2] == "-"),
            ({"choice": ["alpha", "beta \"quoted\""]}, lambda t: t in ("alpha", "beta \"quoted\"")),
            ({"grammar": 'start: "yes" | "no"'}, lambda t: t in ("yes", "no")),
            ({"grammar": 'root ::= "up" | "down"'}, lambda t: t in ("up", "down"))]
    for ask, ok in asks:
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=1.0,
                                               seed=9, extra_body={"structured_outputs": ask})
        assert ok(reply.choices[0].message.content), (ask, reply.choices[0].message.content)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                            stream=True, response_format={
                                                "type": "json_schema",
                                                "json_schema": {"name": "item", "schema": Item.model_json_schema(),
                                                                "strict": True}})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    Item.model_validate_json(streamed)


SCHEMA_PARAM = "response_format.json_schema.schema"


def _json_schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


BAD = [
    ("invalid-schema", CHAT, {"response_format": _json_schema({"type": "strng"})}, SCHEMA_PARAM, "Invalid type"),
    ("unsupported-keyword", CHAT, {"response_format": _json_schema({"type": "array", "uniqueItems": True})},
     SCHEMA_PARAM, "uniqueItems"),
    ("schema-not-object", CHAT, {"response_format": _json_schema("nope")}, SCHEMA_PARAM, "JSON schema"),
    ("no-json-schema", CHAT, {"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
    ("unknown-type", COMPLETIONS, {"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ("regex-matching-nothing", COMPLETIONS, {"structured_outputs": {"regex": "[^\\s\\S]"}},
     "structured_outputs.regex", "matches no output"),
    ("regex-not-parsing", CHAT, {"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "unclosed"),
    ("grammar-not-parsing", CHAT, {"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar",
     "unknown name"),
    ("json-text-not-json", COMPLETIONS, {"structured_outputs": {"json": "{oops"}}, "structured_outputs.json",
     "not JSON"),
    ("two-kinds", CHAT, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("unknown-kind", CHAT, {"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs.structural_tag",
     "not supported"),
    ("both-fields", CHAT, {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not both"),
    ("empty-choice", CHAT, {"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ("with-ignore-eos", COMPLETIONS, {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos",
     "ignore_eos"),
    ("too-big", CHAT, {"structured_outputs": {"regex": "a" * (256 * 1024 + 1)}}, "structured_outputs.regex",
     "at most"),
]


@pytest.mark.parametrize("path,fields,param,why", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_structured_outputs_are_400s_naming_the_field(http, path, fields, param, why):
    base = {"model": "tiny", "max_tokens": 4}
    base.update({"prompt": "x"} if path == COMPLETIONS else {"messages": MESSAGES})
    before = wait_kv_baseline(http)
    r = http.post(path, json={**base, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and why in err["message"], err
    after = wait_kv_baseline(http)
    assert after["pdserve_kv_cache_blocks_free"] == before["pdserve_kv_cache_blocks_free"]


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path, pdserve_cache):
    from pdserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(EngineConfig(model=None, cache_dir=str(pdserve_cache), device="cpu",
                                                  max_model_len=512))
    try:
        with ServerThread(build_app(engine, WorkerConfig())) as srv:
            yield srv
    finally:
        engine.shutdown()


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=100)  # bounded: a float's digits may run on past max_tokens


def test_parse_with_a_pydantic_model_on_smollm2(smollm2_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe Paris as JSON: name, country, population."}],
        response_format=City, max_tokens=40, temperature=0)
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert "paris" in city.name.lower() and "france" in city.country.lower(), city


def test_a_grammar_slower_to_compile_than_the_bound_is_a_400(http, engine, monkeypatch):
    monkeypatch.setattr(engine.engine.guides.grammars.sandbox, "timeout_s", 1e-6)
    schema = {"type": "object", "properties": {f"slow{i}": {"type": "integer"} for i in range(50)}}  # not cached yet
    r = http.post(CHAT, json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4,
                              "response_format": _json_schema(schema)})
    assert r.status_code == 400 and r.json()["error"]["param"] == SCHEMA_PARAM, r.text
    assert "longer than" in r.json()["error"]["message"]
