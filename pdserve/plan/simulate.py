"""Serving in simulated time: the scheduler's own policy, stepped with the cost model's step times.

An instance runs the engine's schedule (scheduler.py): each step, every running sequence in
admission order takes its next tokens (a decode token, or the next prefill chunk) while the step's
token budget (max_num_tokens) lasts, then waiting requests are admitted into what is left (a prompt
that would be left a sliver waits, step_budget.sliver_waits). The step
takes StepCost.step seconds; a sequence whose prompt is complete gets its first token at the end of
that step, a decoding one its next token.

A deployment is instances of roles fed in order:

- aggregated: requests go round robin to the instances, which prefill and decode them;
- disaggregated: a context instance prefills (its requests stop at the first token), the KV moves
  (fixed + bytes / bandwidth, plus one HTTP hop under context_first; under generation_first the
  generation instance asked first and, with pipelined transfer, only the last chunk's KV is left to
  move), and a generation instance takes the request at its next step boundary and decodes it.

Serving's own time, as the profile's serving probe measured it, is added per request, per step and
per decode row of a step (each streamed token takes CPU the steps share).

Not modelled: KV memory limits (preemption), the orchestrator's routing beyond round robin, cores shared
between instances, and prefix caching (every prompt is new, as in `pdserve bench sweep`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from pdserve.bench.arrivals import arrival_offsets
from pdserve.engine.step_budget import sliver_waits
from pdserve.engine.step_budget import MARGIN, prefill_allowance
from pdserve.plan.costmodel import StepCost, TransferCost

# Used when the profile has no serving probe (one core, CUDA); otherwise the probe's figures replace them.
HOP_S = 0.004  # one extra HTTP request (orchestrator -> generation instance) and its answer
STEP_OVERHEAD_S = 0.0005  # scheduling, sampling bookkeeping and streaming of one engine step


@dataclass
class Workload:
    input_len: int
    output_len: int
    num_requests: int = 200
    seed: int = 0

    def arrivals(self, rate: float) -> np.ndarray:
        """Poisson arrival times at `rate` req/s, drawn as `pdserve bench` draws them (the same seed gives the
        same requests' times), and the same unit-rate draws scaled at every rate, so rates compare fairly."""
        return arrival_offsets(self.num_requests, rate, self.seed)


@dataclass
class SimulatedInstance:
    cost: StepCost
    max_num_tokens: int
    max_num_seqs: int = 64
    step_extra_s: float = STEP_OVERHEAD_S  # serving's time per step beyond the forward pass
    row_extra_s: float = 0.0  # ... and per decode row of it (streaming each token costs CPU the steps share)
    prefill_factor: float = 1.0  # a step with prefill rows takes this times the profile's bare step
    tpot_slo_ms: float | None = None  # the engine's tpot_slo_ms (step_budget.py), on the profile's step costs
    min_prefill: int = 32  # ... and its floor, one KV block

    def step_seconds(self, chunks: list[tuple[int, int]], batch: int, context_tokens: int) -> float:
        step = self.cost.step(chunks, batch, context_tokens)
        return (step * self.prefill_factor if chunks else step) + self.step_extra_s + self.row_extra_s * batch

    def prefill_cap(self, running: list[list[int]], first: np.ndarray, prompt: int, outputs: int, computed: int,
                    now: float) -> int:
        """The engine's tpot_slo_ms budget for this step (max_num_tokens without one)."""
        if self.tpot_slo_ms is None:
            return self.max_num_tokens
        decoding = [(seq[2], max(outputs - seq[2] - 1, 0), float(first[seq[0]]), prompt + seq[2])
                    for seq in running if seq[1] >= prompt]
        offset = next((seq[1] for seq in running if seq[1] < prompt), computed)

        def seconds(n: int, contexts: list[int]) -> float:
            return self.step_seconds([(n, offset)] if n else [], len(contexts), sum(contexts))

        return prefill_allowance(self.tpot_slo_ms / 1000 * MARGIN, self.max_num_tokens, self.min_prefill, decoding,
                                 now, seconds)


def run_instance(spec: SimulatedInstance, ready: np.ndarray, prompt: int, outputs: int,
                 computed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One instance serving requests that become ready at `ready` (sorted), each with `prompt` tokens of
    which `computed` arrive computed (generation side: the KV came), to `outputs` tokens in all.
    Returns per request (time of its first token, time of its last token)."""
    n = len(ready)
    first = np.full(n, math.nan)
    last = np.full(n, math.nan)
    order = np.argsort(ready, kind="stable")
    waiting: deque[int] = deque()
    running: list[list[int]] = []  # [request, tokens computed, tokens generated]
    nxt, t, done = 0, 0.0, 0
    budget_max = spec.max_num_tokens
    while done < n:
        while nxt < n and ready[order[nxt]] <= t:
            waiting.append(int(order[nxt]))
            nxt += 1
        if not running and not waiting:
            t = float(ready[order[nxt]])
            continue
        budget = budget_max
        prefill = spec.prefill_cap(running, first, prompt, outputs, computed, t)
        chunks: list[tuple[int, int]] = []
        work: list[tuple[list[int], int]] = []
        batch = ctx_tokens = 0
        for seq in running:
            if budget <= 0:
                break
            if seq[1] < prompt:  # prefill chunk
                k = min(prompt - seq[1], budget, prefill)
                if k <= 0:
                    continue
                prefill -= k
                chunks.append((k, seq[1]))
            else:  # decode: one token, reading prompt + generated tokens of KV
                k = 1
                batch += 1
                ctx_tokens += prompt + seq[2]
            work.append((seq, k))
            budget -= k
        while waiting and budget > 0 and prefill > 0 and len(running) < spec.max_num_seqs:
            k = min(prompt - computed, budget, prefill)
            if 0 < prompt - computed - k and sliver_waits(prompt - computed - k, budget_max, bool(chunks)):
                break  # it heads the next step whole (the engine's rule)
            req = waiting.popleft()
            seq = [req, computed, 1 if computed >= prompt else 0]
            running.append(seq)
            if computed >= prompt:  # its first token came with the KV: out at this step's start
                first[req] = t
                if outputs <= 1:
                    last[req] = t
                    running.remove(seq)
                    done += 1
                continue
            prefill -= k
            chunks.append((k, computed))
            work.append((seq, k))
            budget -= k
        if not work:
            continue
        t += spec.step_seconds(chunks, batch, ctx_tokens)
        for seq, k in work:
            if seq[1] < prompt:
                seq[1] += k
                if seq[1] < prompt:
                    continue
                first[seq[0]] = t
            seq[2] += 1
            if seq[2] >= outputs:
                last[seq[0]] = t
                running.remove(seq)
                done += 1
    return first, last


@dataclass
class Deployment:
    """What the simulator runs; candidates.py builds these and their cluster.yaml."""

    kind: str  # "aggregated" | "disaggregated"
    instances: list[SimulatedInstance]  # aggregated: every instance; disaggregated: the generation instances
    context: list[SimulatedInstance] | None = None
    transfer: TransferCost | None = None
    kv_bytes_per_token: int = 0
    schedule_style: str = "context_first"
    pipelined_chunk: int | None = None  # generation_first with pipelined transfer: KV left after the last chunk
    request_extra_s: float = 0.0  # serving's time per request beyond the steps (HTTP, tokenizing, hops)
    # ... and the part of it that grows with the prompt, as a multiple of its bare prefill: latency that takes
    # no engine time (disaggregated: see candidates.py)
    prefill_extra: float = 0.0
    hop_s: float = HOP_S  # context_first's extra HTTP hop, unless request_extra_s already holds it
    state_bytes: int = 0  # a hybrid model's recurrent state, moved once per request (with the last piece)


@dataclass
class Outcome:
    ttft: np.ndarray  # s per request
    tpot: np.ndarray  # s per request (0 when one token)

    def attainment(self, ttft_s: float, tpot_s: float) -> float:
        return float(np.mean((self.ttft <= ttft_s) & (self.tpot <= tpot_s)))

    def percentile(self, what: str, q: float) -> float:
        return float(np.percentile(getattr(self, what), q))


def _round_robin(times: np.ndarray, k: int) -> list[np.ndarray]:
    idx = np.argsort(times, kind="stable")
    return [idx[i::k] for i in range(k)]


def simulate(dep: Deployment, wl: Workload, rate: float) -> Outcome:
    arrivals = wl.arrivals(rate)
    n, L, M = wl.num_requests, wl.input_len, wl.output_len
    first = np.empty(n)
    last = np.empty(n)
    if dep.kind == "aggregated":
        for inst, idx in zip(dep.instances, _round_robin(arrivals, len(dep.instances))):
            f, la = run_instance(inst, arrivals[idx], L, M)
            first[idx], last[idx] = f, la
    else:
        prefilled = np.empty(n)
        for inst, idx in zip(dep.context, _round_robin(arrivals, len(dep.context))):
            prefilled[idx], _ = run_instance(inst, arrivals[idx], L, 1)
        if dep.schedule_style == "generation_first" and dep.pipelined_chunk:
            moved = min(L, dep.pipelined_chunk) * dep.kv_bytes_per_token + dep.state_bytes
            kv_ready = prefilled + dep.transfer.seconds(moved)
        else:
            extra = dep.hop_s if dep.schedule_style == "context_first" else 0.0
            kv_ready = prefilled + extra + dep.transfer.seconds(L * dep.kv_bytes_per_token + dep.state_bytes)
        for inst, idx in zip(dep.instances, _round_robin(kv_ready, len(dep.instances))):
            f, la = run_instance(inst, kv_ready[idx], L, M, computed=L)
            first[idx], last[idx] = f, la
    first_stage = dep.instances[0] if dep.kind == "aggregated" else dep.context[0]
    ttft = first - arrivals + dep.request_extra_s + dep.prefill_extra * first_stage.cost.prefill(L)
    tpot = np.where(M > 1, (last - first) / max(M - 1, 1), 0.0)
    return Outcome(ttft, tpot)
