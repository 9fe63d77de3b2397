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
    # With SamplingParams.n > 1: every choice in order, this one (choice 0) first.
    choices: list["Completion"] = field(default_factory=list)


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
        keys = [(r, c) for r, sp in zip(rids, params_list) for c in range(sp.n)]
        tokens: dict[tuple[str, int], list[int]] = {k: [] for k in keys}
        text = {k: "" for k in keys}
        logprobs: dict[tuple[str, int], list[dict]] = {k: [] for k in keys}
        done: dict[tuple[str, int], object] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                k = (out.request_id, out.index)
                tokens[k] += out.new_token_ids
                text[k] += out.new_text
                logprobs[k] += out.new_logprobs
                if out.finished:
                    done[k] = out

        def completion(p: list[int], k: tuple[str, int]) -> Completion:
            return Completion(p, tokens[k], text[k], done[k].finish_reason, done[k].num_cached_tokens, logprobs[k])

        results = []
        for p, r, sp in zip(ids, rids, params_list):
            choices = [completion(p, (r, c)) for c in range(sp.n)]
            if sp.n > 1:
                choices[0].choices = list(choices)
            results.append(choices[0])
        return results

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
