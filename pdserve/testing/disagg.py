"""Drive a context engine and a generation engine in one process, the way the orchestrator drives two
servers with schedule_style context_first: prefill every prompt as context_only, then continue each
as generation_only from the first token and the context's endpoint. No HTTP; the KV moves through
the engines' real transceivers."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.output import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import DisaggInfo, RequestType
from pdserve.server.handoff import context_answer_params, first_gen_logprobs


@dataclass
class Generated:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


def step_until(engines: list[LLMEngine], done, limit: int = 5000) -> list:
    """Step every engine in turn until `done(all outputs so far)`; an error after `limit` rounds."""
    outs = []
    for _ in range(limit):
        for e in engines:
            outs += e.step()
        if done(outs):
            return outs
    raise AssertionError(f"engines did not finish within {limit} rounds")


def assert_nothing_held(*engines: LLMEngine) -> None:
    """Every KV block and recurrent-state slot of each engine is free (no request leaked one)."""
    for e in engines:
        held = e.blocks.num_blocks - e.blocks.num_free_blocks
        assert not held, f"{held} KV blocks held"
        assert e.blocks.num_free_state_slots == e.blocks.num_state_slots, "a state slot is held"


def handoff(ctx: LLMEngine, answer: RequestOutput) -> DisaggInfo:
    """The generation half of `ctx`'s finished context_only `answer`, through the HTTP shape an
    orchestrator carries (disaggregated_params, the first token's logprobs in opaque_state)."""
    d = context_answer_params(answer.context, ctx.kv_endpoint)
    return DisaggInfo(d["disagg_request_id"], d["ctx_info_endpoint"], 0, tuple(d["first_gen_tokens"]),
                      first_gen_logprobs(d["opaque_state"]))


def context_first(ctx: LLMEngine, gen: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                  first_id: int = 1000, limit: int = 5000) -> list[Generated]:
    """Each prompt prefilled on `ctx`, decoded on `gen`; what `gen` returned, in prompt order. Both
    engines are stepped until neither holds a request, so every transfer has settled."""
    for i, p in enumerate(prompts):
        ctx.add_request(p, params, f"c{i}", RequestType.CONTEXT_ONLY, DisaggInfo(first_id + i))
    done = {o.request_id: o for o in step_until([ctx], lambda outs: sum(o.finished for o in outs) == len(prompts))
            if o.finished}
    for i, p in enumerate(prompts):
        gen.add_request(p, params, f"g{i}", RequestType.GENERATION_ONLY, handoff(ctx, done[f"c{i}"]))
    results = {f"g{i}": Generated() for i in range(len(prompts))}
    for o in step_until([ctx, gen], lambda _: not ctx.has_unfinished() and not gen.has_unfinished(), limit):
        if o.request_id in results:
            results[o.request_id].token_ids += o.new_token_ids
            results[o.request_id].logprobs += o.new_logprobs
            if o.finished:
                results[o.request_id].finish_reason, results[o.request_id].error = o.finish_reason, o.error
    return [results[f"g{i}"] for i in range(len(prompts))]
