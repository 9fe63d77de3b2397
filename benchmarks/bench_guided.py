"""Structured outputs' cost in the engine loop: tokens/s of guided against unguided requests (same prompt, same
length), aggregated and disaggregated, and the mask's cost per step.

    python benchmarks/bench_guided.py [--model DIR] [--tokens 128] [--batch 1 8] [--rounds 3]

Every request decodes exactly --tokens tokens: unguided ones with ignore_eos, guided ones under a JSON schema
that cannot end sooner (an array of at least 1000 small objects), so the two do the same forward work. Rows:
  - aggregated: one engine (LLMEngine), --batch requests at once;
  - disaggregated: a context and a generation engine in this process, the KV over shared memory
    (pdserve.testing.disagg.context_first: prefill all, then decode all on the generation engine);
tokens/s is the batch's generated tokens over the wall time of the whole run (prefill included, the same in
both), best of --rounds. "mask us/step" is rank 0's time in Guides.mask per sequence and step (the matcher
brought up to the output, then the mask filled) and "sampler us/row" the sampler's time per row, both from
the guided run; "step ms" is the mean step time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import GuidedSpec, SamplingParams

SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                     "name": {"type": "string", "maxLength": 12},
                                     "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}},
    "required": ["rows"], "additionalProperties": False}
PROMPT = "List the inventory as JSON rows with an id, a name and whether it is ok."


class Timed:
    """Wraps a callable and sums the seconds spent in it."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t
            self.calls += 1


def _params(tokens: int, guided: bool) -> SamplingParams:
    if guided:
        return SamplingParams(max_tokens=tokens, temperature=0.0, guided=GuidedSpec("json", json.dumps(SCHEMA)))
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def run_aggregated(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, int]:
    """Seconds, tokens generated, steps."""
    ids = [eng.add_request(p, params) for p in prompts]
    t, steps, tokens = time.perf_counter(), 0, 0
    left = set(ids)
    while left:
        for o in eng.step():
            tokens += len(o.new_token_ids)
            if o.finished:
                assert o.finish_reason == "length", (o.finish_reason, o.error)
                left.discard(o.request_id)
        steps += 1
    return time.perf_counter() - t, tokens, steps


def run_disaggregated(ctx: LLMEngine, gen: LLMEngine, prompts, params, first_id: int) -> tuple[float, int, int]:
    from pdserve.testing.disagg import context_first

    t = time.perf_counter()
    got = context_first(ctx, gen, prompts, params, first_id=first_id)
    seconds = time.perf_counter() - t
    assert all(g.finish_reason == "length" for g in got), [(g.finish_reason, g.error) for g in got]
    return seconds, sum(len(g.token_ids) for g in got), 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="an HF model directory or GGUF (default: embedded SmolLM2)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-disagg", action="store_true")
    args = ap.parse_args()
    common = dict(model=args.model, device="cpu", max_model_len=1024, num_kv_blocks=256)
    eng = LLMEngine(EngineConfig(**common))
    ids = eng.tokenizer.encode(eng.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                                 add_generation_prompt=True), add_special_tokens=False)
    mask = eng.guides.mask = Timed(eng.guides.mask)
    import pdserve.engine.model_runner as mr

    sampler = mr.sample = Timed(mr.sample)
    rows = []
    pair = None
    if not args.no_disagg:
        tc = {"backend": "shm", "kv_transfer_timeout_ms": 30000}
        pair = [LLMEngine(EngineConfig(**common, cache_transceiver_config=tc)) for _ in range(2)]
    first_id = 1000
    load0 = os.getloadavg()[0]
    for batch in args.batch:
        prompts = [ids] * batch
        for mode in ["aggregated"] + ([] if pair is None else ["disaggregated"]):
            result = {}
            for guided in (False, True):
                best = None
                for _ in range(args.rounds):
                    mask.seconds = mask.calls = sampler.seconds = sampler.calls = 0
                    if mode == "aggregated":
                        secs, toks, steps = run_aggregated(eng, prompts, _params(args.tokens, guided))
                    else:
                        secs, toks, steps = run_disaggregated(*pair, prompts, _params(args.tokens, guided), first_id)
                        first_id += batch
                    stats = (secs, toks, steps, mask.seconds / max(1, mask.calls),
                             sampler.seconds / max(1, sampler.calls) / batch)
                    best = stats if best is None or secs < best[0] else best
                result[guided] = best
            rows.append((mode, batch, result))
    load1 = os.getloadavg()[0]
    print(f"{eng.model_name}, {args.tokens} tokens a request, greedy, best of {args.rounds}; "
          f"load average {load0:.2f} -> {load1:.2f}")
    print(f"{'mode':14} {'batch':>5} {'unguided tok/s':>14} {'guided tok/s':>12} {'guided/unguided':>15} "
          f"{'step ms':>8} {'mask us/step':>12} {'sampler us/row':>15} {'(unguided)':>10}")
    for mode, batch, r in rows:
        u, g = r[False], r[True]
        ut, gt = u[1] / u[0], g[1] / g[0]
        step_ms = f"{g[0] / g[2] * 1e3:8.2f}" if g[2] else f"{'-':>8}"
        mask_us = f"{g[3] * 1e6:12.1f}" if mode == "aggregated" else f"{'-':>12}"
        print(f"{mode:14} {batch:5d} {ut:14.1f} {gt:12.1f} {gt / ut:14.3f}x {step_ms} {mask_us} "
              f"{g[4] * 1e6:15.1f} {u[4] * 1e6:10.1f}")
    eng.shutdown()
    for e in pair or []:
        e.shutdown()


if __name__ == "__main__":
    main()
