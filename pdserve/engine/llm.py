"""Offline batch generation: `LLM(config).generate(prompts, params)`. Used by tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    # With SamplingParams.logprobs: one {"token_id", "logprob", "top": [(id, logprob), ...]} per token.
    logprobs: list[dict] = field(default_factory=list)


class LLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.engine = LLMEngine(config or EngineConfig(**kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: list[list[int] | str],
                 params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """All prompts are submitted at once and batched by the scheduler; results keep prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        rids = [self.engine.add_request(p, sp) for p, sp in zip(ids, params_list)]
        tokens = {r: [] for r in rids}
        text = {r: "" for r in rids}
        logprobs: dict[str, list[dict]] = {r: [] for r in rids}
        done: dict[str, object] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                tokens[out.request_id] += out.new_token_ids
                text[out.request_id] += out.new_text
                logprobs[out.request_id] += out.new_logprobs
                if out.finished:
                    done[out.request_id] = out
        return [Completion(p, tokens[r], text[r], done[r].finish_reason, done[r].num_cached_tokens, logprobs[r])
                for p, r in zip(ids, rids)]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
