"""A request's structured-output fields -> the engine's GuidedSpec, every refusal a 400 naming the field.

Two ways to ask (docs/server.md, "Structured outputs"):
- OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"} (any JSON object), or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}};
- vLLM's extension `structured_outputs`, exactly one of: {"json": schema (object or its text)},
  {"regex": "..."}, {"choice": ["a", "b"]}, {"grammar": "..."} (Lark as llguidance reads it, or GBNF, told
  apart by its `::=`), {"json_object": true}.
The schema, regex or grammar is compiled by the engine's grammar cache (engine/guided.py) before the request
is submitted, so a bad one is a 400 before any compute.
"""

from __future__ import annotations

import asyncio
import json

from pdserve.engine.guided import COMPILE_TIMEOUT_S, CompilersBusy, Grammars, GuidedError
from pdserve.engine.sampling_params import GuidedSpec
from pdserve.server.errors import APIError, bad_request

ANY_OBJECT = json.dumps({"type": "object"})
# What a request may wait for its grammar: its turn at a sandbox child, the child's compile (killed past
# COMPILE_TIMEOUT_S) and the server's own compile of what the child passed. Past it the request is refused;
# the server's compile, which cannot be stopped, goes on and is cached.
WAIT_S = 3 * COMPILE_TIMEOUT_S
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


async def compiled_spec(grammars: Grammars, req, tools=None) -> GuidedSpec | None:
    """The request's output constraint (its own, or the one its tool_choice forces: server/tools/chat.py), compiled
    (once per distinct spec, in a worker thread: a large schema takes milliseconds) so that a bad one is a 400
    naming its field before any compute."""
    spec = guided_spec(req.response_format, req.structured_outputs)
    if tools is not None and tools.guided is not None:
        if spec is not None:
            raise bad_request("tool_choice required or a named function holds the output to a tool call: send "
                              "no response_format or structured_outputs with it", "tool_choice")
        spec = tools.guided
    if spec is not None:
        try:
            await asyncio.wait_for(asyncio.to_thread(grammars.compile, spec), WAIT_S)
        except CompilersBusy as e:
            raise APIError(503, str(e), e.param, "grammar_compilers_busy") from None
        except GuidedError as e:
            raise bad_request(str(e), e.param) from None
        except TimeoutError:
            raise bad_request(f"the {spec.kind} took longer than {WAIT_S:g} s to compile: simplify it "
                              "(fewer properties, alternatives or counted repetitions)", spec.param) from None
    return spec


def guided_spec(response_format: dict | None, structured_outputs: dict | None) -> GuidedSpec | None:
    """The request's output constraint, None for free text."""
    spec = _from_response_format(response_format)
    if structured_outputs is not None:
        if spec is not None:
            raise bad_request("send either response_format or structured_outputs, not both", "structured_outputs")
        spec = _from_structured_outputs(structured_outputs)
    return spec


def _from_response_format(rf: dict | None) -> GuidedSpec | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec("json", ANY_OBJECT, "response_format")
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be one of text, json_object, json_schema; got {kind!r}",
                          "response_format.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad_request("response_format json_schema needs a json_schema object: {\"name\": ..., \"schema\": "
                          "{...}, \"strict\": true}", "response_format.json_schema")
    name = js.get("name")
    if name is not None and not (isinstance(name, str) and 0 < len(name) <= 64):
        raise bad_request("response_format.json_schema.name must be a string of 1 to 64 characters",
                          "response_format.json_schema.name")
    if "strict" in js and not isinstance(js["strict"], bool) and js["strict"] is not None:
        raise bad_request("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
    schema = js.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise bad_request("response_format.json_schema.schema must be a JSON schema (an object)",
                          "response_format.json_schema.schema")
    return GuidedSpec("json", json.dumps(schema), "response_format.json_schema.schema")


def _from_structured_outputs(so: dict) -> GuidedSpec:
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(k for k in so if k not in _STRUCTURED_KEYS and so[k] not in (None, False))
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]} is not supported; this server takes one of "
                          f"{', '.join(_STRUCTURED_KEYS)}", f"structured_outputs.{unknown[0]}")
    given = [k for k in _STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_request(f"structured_outputs takes exactly one of {', '.join(_STRUCTURED_KEYS)}; got "
                          f"{', '.join(given) or 'none'}", "structured_outputs")
    key = given[0]
    value, param = so[key], f"structured_outputs.{key}"
    if key == "json_object":
        if value is not True:
            raise bad_request("structured_outputs.json_object must be true", param)
        return GuidedSpec("json", ANY_OBJECT, param)
    if key == "json":
        if isinstance(value, str):
            return GuidedSpec("json", value, param)  # compiling it says whether it is JSON
        if not isinstance(value, (dict, bool)):
            raise bad_request("structured_outputs.json must be a JSON schema (an object, or its text)", param)
        return GuidedSpec("json", json.dumps(value), param)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request("structured_outputs.choice must be a non-empty list of non-empty strings", param)
        # Lark string literals share JSON's escapes, so each choice is its JSON text
        return GuidedSpec("grammar", "start: " + " | ".join(json.dumps(c) for c in value), param)
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"{param} must be a non-empty string", param)
    return GuidedSpec("regex" if key == "regex" else "grammar", value, param)
