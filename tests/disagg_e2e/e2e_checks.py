"""The token-for-token check: the same greedy requests sent to a disaggregated pair (through its
orchestrator) and to one aggregated instance must give the same tokens.

Each request is one `Case`. `run_case` sends it with the official `openai` client and reduces the
answer to an `Answer` (text, the token strings from `logprobs` when the case asks for them, counts,
finish reason); two answers are compared field by field so a mismatch names what differs."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import openai

from e2e_cluster import MODEL_NAME, Orchestrator

MAX_TOKENS = 10
# ids 40..109: 70 tokens, several full blocks at 16 or 32 tokens per block plus a partial last one.
PROMPT_IDS = tuple(range(40, 110))
PROMPT_TEXT = ("Disaggregated serving runs the prefill on one instance and the decode on another, "
               "and moves the key and value cache between them exactly once per request.")
MESSAGES = (("user", "Tensor parallelism splits every weight across ranks; what does pipeline parallelism do?"),)


@dataclass(frozen=True)
class Case:
    api: str  # "completions" | "chat"
    stream: bool
    prompt: str | tuple[int, ...] | None = None  # completions
    logprobs: bool = False  # ask for per-token logprobs (completions only): their token strings are compared
    messages: tuple[tuple[str, str], ...] = MESSAGES  # chat: (role, content)

    def salted(self, salt: int) -> "Case":
        """The same case over a prompt no instance has seen: a generation instance allocates blocks that
        may still hold an earlier request's KV, so a repeated prompt could pass without any transfer."""
        if isinstance(self.prompt, tuple):
            prompt = tuple(3 + (t + 17 * salt) % 500 for t in self.prompt)
        else:
            prompt = None if self.prompt is None else f"[{salt}] {self.prompt}"
        messages = tuple((role, f"{content} ({salt})") for role, content in self.messages)
        return Case(self.api, self.stream, prompt, self.logprobs, messages)

    @property
    def label(self) -> str:
        kind = "ids" if isinstance(self.prompt, tuple) else "text"
        return f"{self.api}{'-' + kind if self.api == 'completions' else ''}-{'stream' if self.stream else 'full'}"


CASES = (
    Case("completions", stream=False, prompt=PROMPT_IDS, logprobs=True),
    Case("completions", stream=True, prompt=PROMPT_TEXT),
    Case("chat", stream=False),
    Case("chat", stream=True),
)


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: tuple[str, ...] | None  # logprobs token strings, one per generated token
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str


def _greedy(max_tokens: int) -> dict:
    return {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": max_tokens, "extra_body": {"ignore_eos": True}}


def run_case(client: openai.OpenAI, case: Case, max_tokens: int = MAX_TOKENS, model: str = MODEL_NAME) -> Answer:
    kw = {**_greedy(max_tokens), "model": model}
    if case.api == "completions":
        prompt = list(case.prompt) if isinstance(case.prompt, tuple) else case.prompt
        if case.logprobs:
            kw["logprobs"] = 1
        if not case.stream:
            out = client.completions.create(prompt=prompt, **kw)
            c = out.choices[0]
            tokens = tuple(c.logprobs.tokens) if case.logprobs else None
            return Answer(c.text, tokens, out.usage.completion_tokens, out.usage.prompt_tokens, c.finish_reason)
        chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True},
                                                **kw))
        choices = [ch.choices[0] for ch in chunks if ch.choices]
        tokens = tuple(t for c in choices if c.logprobs for t in c.logprobs.tokens) if case.logprobs else None
        finish = [c.finish_reason for c in choices if c.finish_reason]
        usage = chunks[-1].usage
        return Answer("".join(c.text for c in choices), tokens, usage.completion_tokens, usage.prompt_tokens,
                      finish[-1] if finish else "")
    messages = [{"role": role, "content": content} for role, content in case.messages]
    if not case.stream:
        out = client.chat.completions.create(messages=messages, **kw)
        c = out.choices[0]
        return Answer(c.message.content, None, out.usage.completion_tokens, out.usage.prompt_tokens, c.finish_reason)
    chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    finish = [c.finish_reason for c in choices if c.finish_reason]
    usage = chunks[-1].usage
    return Answer("".join(c.delta.content or "" for c in choices), None, usage.completion_tokens,
                  usage.prompt_tokens, finish[-1] if finish else "")


def diff(case: Case, got: Answer, want: Answer) -> list[str]:
    """Every field where the disaggregated answer differs from the aggregated one, in words."""
    out = []
    if got.text != want.text:
        out.append(f"{case.label}: text {got.text!r} != aggregated {want.text!r}")
    got_tokens, want_tokens = got.tokens, want.tokens
    if got_tokens != want_tokens:
        out.append(f"{case.label}: tokens {got.tokens} != aggregated {want.tokens}")
    for name in ("completion_tokens", "prompt_tokens", "finish_reason"):
        if getattr(got, name) != getattr(want, name):
            out.append(f"{case.label}: {name} {getattr(got, name)!r} != aggregated {getattr(want, name)!r}")
    return out


class Reference:
    """Aggregated answers of one plain instance, computed once per case and shared by every pair."""

    def __init__(self, client: openai.OpenAI, model: str = MODEL_NAME, max_tokens: int = MAX_TOKENS):
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self._answers: dict[Case, Answer] = {}

    def __getitem__(self, case: Case) -> Answer:
        if case not in self._answers:
            self._answers[case] = run_case(self.client, case, self.max_tokens, self.model)
        return self._answers[case]


def check_pair(client: openai.OpenAI, reference: Reference, cases=CASES, salt: str = "") -> None:
    """Send every case (salted with `salt`, so its prompts are new to the instances) through `client` and
    assert each answer equals the reference's."""
    problems = []
    for case in cases:
        case = case.salted(zlib.crc32(salt.encode()) % 997) if salt else case
        problems += diff(case, run_case(client, case, reference.max_tokens, reference.model), reference[case])
    assert not problems, "disaggregated output differs from aggregated:\n" + "\n".join(problems)


def check_split(group: dict, ctx: str, gen: str, reference: Reference, workdir, cases=CASES,
                **orchestrator) -> None:
    """Through a fresh orchestrator (extra config keys: `orchestrator`) over group[ctx] -> group[gen]:
    every case equals the reference, and afterwards neither instance holds a KV block (the transfer
    released both sides)."""
    name = "-".join([ctx, gen, *map(str, orchestrator.values())])
    with Orchestrator(group[ctx].url, group[gen].url, workdir, name, **orchestrator) as orch:
        check_pair(orch.client(), reference, cases, salt=name)
    for name in (ctx, gen):
        group[name].wait_blocks_free()
