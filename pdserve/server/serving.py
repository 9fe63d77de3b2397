"""Serving logic for /v1/completions and /v1/chat/completions, independent of the web framework.

Each request becomes: check the model and unsupported fields -> prompt token ids -> SamplingParams
-> `engine.generate`, whose first output is awaited before answering, so every refusal (context
length, bad token ids) is a 400 rather than a broken stream. The answer is either a response model
or, for `stream: true`, an async iterator of SSE lines ending with `data: [DONE]`.

Closing that iterator (the client went away) closes the engine's generator, which aborts the
request and frees its KV blocks; it is an `OwnedStream`, so this holds even when the client left
before the first chunk and the SSE generator never started.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from contextlib import aclosing
from typing import AsyncIterator

from pdserve.engine.llm_engine import ConflictError, RequestError
from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling_params import GuidedSpec, SamplingParams
from pdserve.engine.scheduler import GRAMMAR_FAILED, KV_NOT_FOUND
from pdserve.engine.sequence import DisaggInfo, RequestType, Resume, num_answers
from pdserve.server.chat_prompt import prompt_text, renders_in_place
from pdserve.server.errors import APIError, bad_request
from pdserve.server.guided_request import compiled_spec
from pdserve.server.handoff import answer_choices, context_answer_params, first_gen_logprobs
from pdserve.server.metrics import ServerMetrics
from pdserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    PromptTokensDetails,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    Usage,
    random_id,
)
from pdserve.server.streaming import OwnedStream
from pdserve.server.tools.chat import CallStream, assistant_message, tool_setup

SSE_DONE = "data: [DONE]\n\n"
# A logit_bias key: ASCII digits, few enough for int() (str.isdigit also passes '²', which int() refuses).
_TOKEN_ID = re.compile(r"[0-9]{1,18}")
# Texts shorter than this hold the event loop too briefly to matter and are encoded on it, longer ones
# in a worker thread
_ENCODE_IN_PLACE = 8192


# Characters JSON may leave raw inside a string that str.splitlines (httpx's aiter_lines, requests'
# iter_lines with decode_unicode) takes for line ends; escaped, an event stays one line for such clients.
_LINE_ENDS_IN_JSON = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload) -> str:
    body = payload if isinstance(payload, str) else payload.model_dump_json()
    if not body.isascii():
        body = body.translate(_LINE_ENDS_IN_JSON)
    return f"data: {body}\n\n"


def usage_of(*outs: RequestOutput) -> Usage:
    """The usage of a request from each choice's last output: its prompt once, every choice's completion."""
    out, completion = outs[0], sum(o.num_output_tokens for o in outs)
    return Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=completion,
                 total_tokens=out.num_prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in rest:
        yield out


class OpenAIServing:
    def __init__(self, engine, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self._token_strs: dict[int, str] = {}
        self.draining = False  # shutting down: new requests are refused (503 draining), running ones finish

    # -- /v1/completions --------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        self._check_common(req)
        if req.echo:
            raise bad_request("echo=true is not supported; send echo=false and prepend the prompt yourself", "echo")
        if req.suffix:
            raise bad_request("suffix is not supported (this server does not do fill-in-the-middle)", "suffix")
        if req.best_of not in (None, 1):
            raise bad_request(f"best_of must be 1, got {req.best_of}", "best_of")
        ids = await self._completion_prompt(req.prompt)
        params = self._sampling_params(req, req.max_tokens, logprobs=req.logprobs,
                                       guided=await compiled_spec(self.engine.grammars, req))
        rid, created = self._identity(req, "cmpl")
        outputs, first = await self._start(rid, ids, params, req, {})
        if req.stream:
            return OwnedStream(self._stream_completion(req, rid, created, outputs, first), outputs)
        n = answer_choices(req)
        texts, logprobs, lasts = [""] * n, [None] * n, [first] * n
        async with aclosing(outputs):
            async for out in _chain(first, outputs):
                i = out.index
                logprobs[i] = self._completion_logprobs(out, len(texts[i]), logprobs[i])
                texts[i], lasts[i] = texts[i] + out.new_text, out
        for last in lasts:
            self._raise_if_failed(last)
        choices = [CompletionChoice(index=i, text=texts[i], logprobs=logprobs[i], finish_reason=last.finish_reason,
                                    stop_reason=last.stop_reason) for i, last in enumerate(lasts)]
        return CompletionResponse(id=rid, created=created, model=self.engine.model_name, choices=choices,
                                  usage=usage_of(*lasts), disaggregated_params=self._handoff(lasts[0]))

    async def _stream_completion(self, req, rid, created, outputs, first) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        offsets = [req.resume.sent_chars if req.resume else 0] * req.n  # each choice's text so far
        lasts: dict[int, RequestOutput] = {}
        async with aclosing(outputs):
            out = first
            while True:
                if out.finish_reason == "error":
                    yield sse(self._error_body(out))
                    break
                i = out.index
                choice = CompletionChoice(index=i, text=out.new_text, logprobs=self._completion_logprobs(out, offsets[i]),
                                          finish_reason=out.finish_reason, stop_reason=out.stop_reason)
                offsets[i] += len(out.new_text)
                yield self._with_ids(req, CompletionChunk(id=rid, created=created, model=self.engine.model_name,
                                                          choices=[choice]), out)
                if out.finished:
                    lasts[i] = out
                if len(lasts) == req.n:
                    if include_usage:
                        yield sse(CompletionChunk(id=rid, created=created, model=self.engine.model_name,
                                                  choices=[], usage=usage_of(*lasts.values())))
                    break
                out = await anext(outputs)
        yield SSE_DONE

    # -- /v1/chat/completions ---------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        self._check_common(req)
        tools = tool_setup(req.tools, req.tool_choice, req.parallel_tool_calls, self.tokenizer.chat_template,
                           self.tokenizer)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        ids = await self._chat_prompt(req, tools)
        max_tokens, max_tokens_param = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            max_tokens, max_tokens_param = req.max_completion_tokens, "max_completion_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(req, max_tokens, logprobs=logprobs, max_tokens_param=max_tokens_param,
                                       guided=await compiled_spec(self.engine.grammars, req, tools),
                                       kept=tools.kept_special_ids if tools is not None else ())
        rid, created = self._identity(req, "chatcmpl")
        fields = {"prompt": "messages", "max_tokens": max_tokens_param}
        outputs, first = await self._start(rid, ids, params, req, fields)
        if req.stream:
            return OwnedStream(self._stream_chat(req, rid, created, outputs, first, tools), outputs)
        n = answer_choices(req)
        texts, lasts = [""] * n, [first] * n
        lps = [ChatLogprobs(content=[]) if req.logprobs else None for _ in range(n)]
        async with aclosing(outputs):
            async for out in _chain(first, outputs):
                i = out.index
                texts[i], lasts[i] = texts[i] + out.new_text, out
                if lps[i] is not None and out.new_logprobs:
                    lps[i].content += self._chat_logprobs(out).content
        for last in lasts:
            self._raise_if_failed(last)
        messages = [assistant_message(texts[i], last.finish_reason, tools) for i, last in enumerate(lasts)]
        choices = [ChatChoice(index=i, message=messages[i][0], logprobs=lps[i], finish_reason=messages[i][1],
                              stop_reason=last.stop_reason) for i, last in enumerate(lasts)]
        return ChatCompletionResponse(id=rid, created=created, model=self.engine.model_name, choices=choices,
                                      usage=usage_of(*lasts), disaggregated_params=self._handoff(lasts[0]))

    async def _stream_chat(self, req, rid, created, outputs, first, tools=None) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices, usage=None, out: RequestOutput | None = None) -> str:
            return self._with_ids(req, ChatCompletionChunk(id=rid, created=created, model=self.engine.model_name,
                                                           choices=choices, usage=usage), out)

        async with aclosing(outputs):
            if req.resume is None:  # a resumed stream's client has had its opening chunk
                for i in range(req.n):
                    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            out, lasts, held = first, {}, {}  # held: each tool-calling choice's CallStream
            while True:
                if out.finish_reason == "error":
                    yield sse(self._error_body(out))
                    break
                if tools is not None and tools.parse:  # content at once, a call's text held until the choice ends
                    stream = held.setdefault(out.index, CallStream(tools, out.index))
                    for c in stream.chunks(out.new_text, out.finished, out.finish_reason):
                        yield chunk([c])
                elif out.new_text or out.new_logprobs or out.finished or (req.return_token_ids and out.new_token_ids):
                    yield chunk([ChatChunkChoice(index=out.index, delta=DeltaMessage(content=out.new_text or None),
                                                 logprobs=self._chat_logprobs(out),
                                                 finish_reason=out.finish_reason, stop_reason=out.stop_reason)],
                                out=out)
                if out.finished:
                    lasts[out.index] = out
                if len(lasts) == req.n:
                    if include_usage:
                        yield chunk([], usage_of(*lasts.values()))
                    break
                out = await anext(outputs)
        yield SSE_DONE

    # -- /tokenize --------------------------------------------------------------------------------

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of 'prompt' or 'messages'")
        if req.prompt is not None:  # (a prompt that its length proves longer than the context window is
            # refused: encoding megabytes holds the event loop for seconds, long enough for an orchestrator
            # that tokenizes to route to find this instance's /health silent and take it out of routing)
            ids = await self._encode(req.prompt, add_special_tokens=req.add_special_tokens, param="prompt")
        else:
            ids = await self._chat_prompt(ChatCompletionRequest(model=self.engine.model_name, messages=req.messages))
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.engine.max_model_len)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens, skip_special_tokens=False))

    # -- shared steps -----------------------------------------------------------------------------

    def _identity(self, req: SamplingFields, prefix: str) -> tuple[str, int]:
        """The response's id and created time: a resumed stream keeps those its client has seen."""
        resume = req.resume
        if resume is not None and not req.stream:
            raise bad_request("resume goes on with a stream: send stream=true", "resume")
        return ((resume and resume.id) or random_id(prefix),
                resume.created if resume is not None and resume.created is not None else int(time.time()))

    def _with_ids(self, req: SamplingFields, chunk, out: RequestOutput | None) -> str:
        """`chunk` as an SSE event; with return_token_ids, its choice carries the ids `out` added."""
        if not req.return_token_ids or out is None or not chunk.choices:
            return sse(chunk)
        body = chunk.model_dump()
        body["choices"][0]["token_ids"] = out.new_token_ids
        return sse(json.dumps(body, ensure_ascii=False, separators=(",", ":")))

    def _check_common(self, req: SamplingFields) -> None:
        if req.model != self.engine.model_name:
            raise APIError(404, f"The model '{req.model}' does not exist; this server serves "
                                f"'{self.engine.model_name}' (see GET /v1/models)", "model", "model_not_found")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        if req.logit_bias and not all(_TOKEN_ID.fullmatch(k.strip()) for k in req.logit_bias):
            raise bad_request("logit_bias keys must be token ids (non-negative integers as strings)", "logit_bias")

    async def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return await self._encode(prompt, param="prompt")
        if not prompt or isinstance(prompt[0], int):
            return list(prompt)  # the engine refuses an empty one
        if len(prompt) != 1:
            raise bad_request(f"prompt holds {len(prompt)} prompts; this server takes one prompt per request",
                              "prompt")
        return await self._encode(prompt[0], param="prompt") if isinstance(prompt[0], str) else list(prompt[0])

    async def _encode(self, text: str, add_special_tokens: bool = True, param: str | None = None) -> list[int]:
        """`param`: the field a prompt too long for the context window is blamed on. Such a prompt is
        refused before encoding when its length alone proves it too long, since encoding it would only hold
        the server up."""
        if not text:
            raise bad_request("prompt is empty", "prompt")
        limit = self.engine.max_model_len
        if param is not None and len(text) >= limit and (least := await self._at_least_tokens(text)) >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt has at "
                              f"least {least} tokens ({len(text)} characters), which leaves no room for a "
                              "completion. Please shorten the prompt.", param, "context_length_exceeded")
        if len(text) < _ENCODE_IN_PLACE:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        # A long text is encoded in a worker thread, which lets go of the GIL meanwhile: every other request
        # keeps its event loop and every running stream its engine steps (docs/reliability.md)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    async def _at_least_tokens(self, text: str) -> int:
        """Tokenizer.at_least_tokens, in a worker thread for a long text (its pass over the text is a regex's,
        which holds the GIL: let it be a short one)."""
        if len(text) < _ENCODE_IN_PLACE:
            return self.tokenizer.at_least_tokens(text)
        return await asyncio.to_thread(self.tokenizer.at_least_tokens, text)

    async def _chat_prompt(self, req: ChatCompletionRequest, tools=None) -> list[int]:
        if renders_in_place(req):
            rendered = prompt_text(self.tokenizer, req, tools)
        else:  # reading megabytes of calls' arguments, thousands of messages or a huge schema holds the loop seconds
            rendered = await asyncio.to_thread(prompt_text, self.tokenizer, req, tools)
        # The template already wrote any BOS it wants; encoding must not add a second one.
        return await self._encode(rendered, add_special_tokens=False, param="messages")

    def _sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                         max_tokens_param: str = "max_tokens", guided: GuidedSpec | None = None,
                         kept: tuple[int, ...] = ()) -> SamplingParams:
        """`max_tokens` None: the engine gives the request what the context window leaves (its one check of
        the context-length rule). `kept`: special tokens that stay in the text (a tool-call syntax's markers)."""
        defaults = self.engine.sampling_defaults  # the checkpoint's recommendations (sampling_defaults.py)
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        recommended = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                           repetition_penalty=req.repetition_penalty)
        fields = dict(**{k: defaults.get(k) if v is None else v for k, v in recommended.items()},
                      presence_penalty=req.presence_penalty,
                      frequency_penalty=req.frequency_penalty, min_tokens=req.min_tokens,
                      logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None)
        try:
            return SamplingParams(max_tokens=max_tokens, seed=req.seed, n=req.n, stop=tuple(stop),
                                  stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                                  include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
                                  guided=guided, skip_special_tokens=req.skip_special_tokens,
                                  kept_special_token_ids=kept,
                                  **{k: v for k, v in fields.items() if v is not None})
        except ValueError as e:
            message = str(e)
            field = message.split(" ", 1)[0]
            if field == "max_tokens":  # name the field the client sent
                field, message = max_tokens_param, message.replace("max_tokens", max_tokens_param, 1)
            known = field in SamplingParams.__dataclass_fields__ or field == max_tokens_param
            raise bad_request(message, field if known else None) from None

    async def _start(self, rid: str, ids: list[int], params: SamplingParams, req: SamplingFields,
                     fields: dict[str, str]):
        """Submit to the engine and wait for the first output, turning a refusal into an APIError. `fields`
        names this API's field for an engine field a refusal blames, where they differ (chat's prompt is
        its messages)."""
        if self.draining:
            raise APIError(503, "this instance is draining (shutting down): send the request to another instance",
                           code="draining")
        request_type, disagg = self._disagg(req)
        resume = req.resume and Resume(tuple(req.resume.token_ids), req.resume.sent_chars)
        outputs = self._outputs(rid, ids, params, request_type, disagg, resume)
        try:
            first = await anext(outputs)
        except ConflictError as e:
            raise APIError(409, str(e), "disaggregated_params.disagg_request_id", "duplicate_request_id") from None
        except RequestError as e:
            param, message = fields.get(e.param, e.param), str(e)
            if e.param == "max_tokens" and param != e.param:
                message = message.replace("max_tokens", param)
            raise bad_request(message, param, e.code) from None
        except RuntimeError as e:
            if self.engine.error:
                raise APIError(503, str(e)) from None
            raise
        if first.finish_reason == "error":  # failed before producing anything: say so in the status
            await outputs.aclose()
            self._raise_if_failed(first)
        return outputs, first

    def _disagg(self, req: SamplingFields) -> tuple[RequestType, DisaggInfo | None]:
        """The request's part in disaggregated serving; the engine checks what needs its transceiver."""
        d = req.disaggregated_params
        if d is None or d.request_type == "context_and_generation":
            return RequestType.CONTEXT_AND_GENERATION, None
        param = "disaggregated_params"
        if d.request_type == "context_only" and req.stream:
            raise bad_request("context_only requests answer once: send stream=false", "stream")
        if d.draft_tokens:
            raise bad_request("draft_tokens are not supported (no speculative decoding yet)", f"{param}.draft_tokens")
        if d.ctx_dp_rank != 0:
            raise bad_request("ctx_dp_rank must be 0 (no attention data parallelism yet)", f"{param}.ctx_dp_rank")
        if d.disagg_request_id is None:
            raise bad_request(f"{d.request_type} needs {param}.disagg_request_id", f"{param}.disagg_request_id")
        info = DisaggInfo(d.disagg_request_id, d.ctx_info_endpoint, d.ctx_dp_rank, tuple(d.first_gen_tokens or ()),
                          first_gen_logprobs(d.opaque_state), d.schedule_style or "context_first")
        return RequestType(d.request_type), info

    def _handoff(self, last: RequestOutput) -> dict | None:
        """A finished context_only answer's disaggregated_params (None on any other answer)."""
        return context_answer_params(last.context, self.engine.kv_endpoint) if last.context is not None else None

    async def _outputs(self, rid: str, ids: list[int], params: SamplingParams, request_type: RequestType,
                       disagg: DisaggInfo | None, resume: Resume | None = None) -> AsyncIterator[RequestOutput]:
        # A normal finish is recorded by the engine's step hook; only requests that end outside a
        # step (client gone -> abort; dead step loop -> error) are recorded here.
        self.metrics.request_started(rid, num_answers(request_type, params.n))
        how = "abort"
        try:
            async with aclosing(self.engine.generate(ids, params, request_id=rid, request_type=request_type,
                                                     disagg=disagg, resume=resume)) as gen:
                async for out in gen:
                    if out.finished:
                        how = "error" if out.finish_reason == "error" else "finished"
                    yield out
        except (RequestError, RuntimeError):
            how = "refused"
            raise
        finally:
            self.metrics.request_ended(rid, how)

    def _raise_if_failed(self, last: RequestOutput) -> None:
        if last.finish_reason == "error":
            raise self._failure(last)

    def _error_body(self, out: RequestOutput) -> str:
        return json.dumps(self._failure(out).body())

    def _failure(self, out: RequestOutput) -> APIError:
        """The step loop died, or the KV this request waited for never came: the service is unavailable
        (503; code kv_transfer_failed tells an orchestrator that another context instance may do). The
        context instance holds no such request (never had it, or its KV was already sent, released or timed
        out): 404 kv_not_found. A grammar that failed on its way is the client's (400). Any other failure is this
        request's own (500)."""
        message = f"generation failed: {out.error}"
        if out.error_code == KV_NOT_FOUND:
            return APIError(404, f"{message}. Send a generation_only request with the disaggregated_params of a "
                                 "context_only answer whose KV is still held", "disaggregated_params.disagg_request_id",
                            KV_NOT_FOUND)
        if out.error_code == GRAMMAR_FAILED:  # the request's grammar failed on its way: the client's to fix
            return APIError(400, f"{message}; simplify the grammar (fewer alternatives open at once)",
                            code=GRAMMAR_FAILED)
        if (out.error or "").startswith("KV transfer"):
            return APIError(503, message, code="kv_transfer_failed")
        return APIError(503 if self.engine.error else 500, message)

    # -- logprobs ---------------------------------------------------------------------------------

    def _token_str(self, token_id: int) -> str:
        """A token's text for logprobs. A token that is only part of a multi-byte character decodes to
        U+FFFD; it is shown as "token_id:<id>" (vLLM's convention) so that distinct tokens never
        share a key in the legacy top_logprobs dict."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if "\ufffd" in s:
                s = f"token_id:{token_id}"
            self._token_strs[token_id] = s
        return s

    def _token_bytes(self, token_id: int) -> list[int] | None:
        s = self._token_str(token_id)
        return None if s.startswith("token_id:") else list(s.encode())

    def _completion_logprobs(self, out: RequestOutput, offset: int,
                             into: CompletionLogprobs | None = None) -> CompletionLogprobs | None:
        if not out.new_logprobs:
            return into
        lp = into if into is not None else CompletionLogprobs()
        for entry in out.new_logprobs:
            tok = self._token_str(entry["token_id"])
            lp.tokens.append(tok)
            lp.token_logprobs.append(entry["logprob"])
            # Legacy format: the top alternatives plus the sampled token, keyed by token text.
            top = {self._token_str(t): p for t, p in entry["top"]}
            top.setdefault(tok, entry["logprob"])
            lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
            offset += len(tok)
        return lp

    def _chat_logprobs(self, out: RequestOutput) -> ChatLogprobs | None:
        if not out.new_logprobs:
            return None
        content = []
        for entry in out.new_logprobs:
            tok = self._token_str(entry["token_id"])
            top = [TopLogprob(token=self._token_str(t), logprob=p, bytes=self._token_bytes(t)) for t, p in entry["top"]]
            content.append(ChatTokenLogprob(token=tok, logprob=entry["logprob"],
                                            bytes=self._token_bytes(entry["token_id"]), top_logprobs=top))
        return ChatLogprobs(content=content)
