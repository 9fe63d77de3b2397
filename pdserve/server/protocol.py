"""OpenAI-compatible request and response bodies (pydantic), and nothing else.

Requests are validated strictly: `"max_tokens": "5"` or `true` is a type error (400), not a silent
coercion. Unknown fields are ignored, as vLLM does, so clients that send newer OpenAI fields keep
working; fields we know but cannot honour (n > 1, echo, tools, ...) are refused with a
400 that names them. Value ranges of sampling parameters are checked once, by `SamplingParams`.

Extensions beyond the OpenAI API (accepted as vLLM accepts them, e.g. through the openai client's
`extra_body`): top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos,
include_stop_str_in_output, skip_special_tokens, structured_outputs (server/guided_request.py), and response_format on
/v1/completions too; on chat also add_generation_prompt.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


# Every list in a request stops at its first bad item (fail_fast). Without it each bad item is an error,
# one per shape a union allows: a 30 MiB `"prompt": [{}, {}, ...]` made 23 M of them, which grew the
# worker past 20 GB until the kernel killed it.
Ints = Annotated[list[int], Field(fail_fast=True)]
Strs = Annotated[list[str], Field(fail_fast=True)]
Dicts = Annotated[list[dict[str, Any]], Field(fail_fast=True)]


class StreamOptions(_Request):
    include_usage: bool = False


class ResumeParams(_Request):
    """Extension, sent by the orchestrator when it moves a stream whose instance was lost: go on with the
    output that instance generated (`token_ids`), of whose text the client already has `sent_chars`
    characters, under the stream's `id` and `created`."""

    token_ids: Ints  # none: the stream had sent only its opening (chat's role chunk)
    sent_chars: int = Field(ge=0)
    id: str | None = Field(None, max_length=256)
    created: int | None = Field(None, ge=0, lt=1 << 63)


# Values that go on into msgpack (int64), ZeroMQ or the tokenizer are bounded here, so that a forged body is a
# 400 naming its field, never an exception in the engine's step loop. Token ids are checked against the
# model's vocabulary by the serving layer and the engine.
RequestId = Annotated[int, Field(ge=0, lt=1 << 63)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
# A context instance's KV control endpoint, as its workers publish it: tcp://HOST:PORT
_ENDPOINT = re.compile(r"tcp://[A-Za-z0-9.\-_:\[\]]{1,253}:([0-9]{1,5})")


class DisaggregatedParams(_Request):
    """The disaggregated-serving handshake (docs/disaggregation.md). On a request it says which part
    this worker does; on a context_only answer it carries what the generation worker needs."""

    request_type: Literal["context_only", "generation_only", "context_and_generation"]
    first_gen_tokens: list[TokenId] | None = Field(None, max_length=128)  # one per choice (n <= 128)
    ctx_request_id: RequestId | None = None
    disagg_request_id: RequestId | None = None
    opaque_state: str | None = Field(None, max_length=1 << 17)  # base64 of the first tokens' logprob entries
    draft_tokens: list[TokenId] | None = Field(None, max_length=64)
    ctx_dp_rank: int = Field(0, ge=0, lt=1 << 16)
    ctx_info_endpoint: str | None = Field(None, max_length=300)
    schedule_style: Literal["context_first", "generation_first"] | None = None

    @field_validator("ctx_info_endpoint")
    @classmethod
    def _tcp_endpoint(cls, v: str | None) -> str | None:
        m = v is not None and _ENDPOINT.fullmatch(v)
        if v is not None and not (m and 0 < int(m.group(1)) < 65536):
            raise ValueError("must be a context instance's KV endpoint tcp://HOST:PORT (its /v1/disagg_info's "
                             "ctx_info_endpoint)")
        return v


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None  # None = 1.0 (OpenAI default)
    top_p: float | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)  # int64, as vLLM takes it
    stop: str | Strs | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions (vLLM-compatible).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: Ints | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    disaggregated_params: DisaggregatedParams | None = None
    # Extensions for stream migration: each streamed choice carries the token ids of its text, and a
    # request may go on from another instance's output (ResumeParams).
    return_token_ids: bool = False
    resume: ResumeParams | None = None
    # Structured outputs (server/guided_request.py reads both): OpenAI's, and vLLM's extension.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    # One prompt: text or token ids. A list of several prompts is a batch, which we refuse (n=1 API).
    prompt: str | Ints | Strs | Annotated[list[Ints], Field(fail_fast=True)]
    max_tokens: int | None = 16
    logprobs: int | None = None  # number of top alternatives per position (legacy API)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A plain string, or a list of content parts of which only text parts are supported.
    content: str | Dicts | None = None
    name: str | None = None
    tool_calls: Dicts | None = None  # an assistant's earlier calls (server/tools/chat.py)
    tool_call_id: str | None = None  # a tool message: the call it answers


# More messages than any context window holds (each renders to a few tokens at least), refused before
# they are validated and rendered, which for hundreds of thousands of messages holds the event loop for
# seconds (docs/reliability.md, "Oversized and hostile requests")
MAX_MESSAGES = 65536


def _at_most_max_messages(messages):
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise ValueError(f"at most {MAX_MESSAGES} messages are allowed, got {len(messages)}")
    return messages


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    _few_enough = field_validator("messages", mode="before")(_at_most_max_messages)
    max_tokens: int | None = None  # None: up to the end of the context window
    max_completion_tokens: int | None = None  # newer OpenAI name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Dicts | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    # Extension: render the assistant turn opener after the messages (default, like OpenAI).
    add_generation_prompt: bool = True


# -- responses (plain models; built by the serving layer, serialised by FastAPI) ------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # extension: the stop string or token id that ended it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    disaggregated_params: dict | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    disaggregated_params: dict | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ReleaseKVRequest(_Request):
    """The orchestrator will not hand this request's KV on: free it (docs/disaggregation.md)."""

    disagg_request_id: int = Field(gt=0, lt=1 << 63)


class TokenizeRequest(_Request):
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, fail_fast=True)
    add_special_tokens: bool = True
    _few_enough = field_validator("messages", mode="before")(_at_most_max_messages)


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Request):
    tokens: Ints


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
