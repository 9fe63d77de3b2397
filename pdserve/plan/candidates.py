"""The deployments a plan weighs on this machine, each with the cluster.yaml that starts it.

On a CPU machine of C cores (the profile's thread counts t = 1, 2, 4, ..., C):

- aggregated: C // t instances of t threads each, for each prefill chunk budget (max_num_tokens), and
  each of those again with the engine's tpot_slo_ms set to the SLO's TPOT (engine/step_budget.py);
- disaggregated: context instances of tc threads and generation instances of tg threads that fill
  the cores, under context_first (the whole prompt in one step) and generation_first (pipelined
  transfer: each chunk's KV leaves while the next is computed).

On CUDA a unit is a GPU: one instance per GPU, and disaggregation needs two.

Every instance is pinned to its own cores (launch's `cpus`), so the instances do not share cores and
the profile's single-instance timings hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.plan.costmodel import StepCost, TransferCost
from pdserve.plan.simulate import Deployment, SimulatedInstance

AGG_CHUNKS = (256, 512, 1024, 2048)
GF_CHUNK = 512  # generation_first's prefill step: the pipelined transfer ships each step's blocks


@dataclass
class Role:
    count: int
    units: int  # threads (CPU) or GPUs per instance
    max_num_tokens: int
    pipelined: bool = False
    tpot_slo_ms: float | None = None  # the engine's TPOT budget for prefill chunks


@dataclass
class Candidate:
    name: str
    kind: str  # aggregated | disaggregated
    generation: Role  # aggregated: the instances
    context: Role | None = None
    schedule_style: str = "context_first"
    notes: list[str] = field(default_factory=list)

    @property
    def layout(self) -> str:
        """In words, e.g. 'ctx 1x1t step 512 + gen 1x1t, gen-first' (instances x threads each)."""
        g = self.generation
        if self.kind == "aggregated":
            budget = f", TPOT budget {g.tpot_slo_ms:g} ms" if g.tpot_slo_ms else ""
            return f"{g.count}x{g.units}t, chunk {g.max_num_tokens}{budget}"
        c = self.context
        style = "gen-first, pipelined" if self.schedule_style == "generation_first" else "ctx-first"
        return f"ctx {c.count}x{c.units}t step {c.max_num_tokens} + gen {g.count}x{g.units}t, {style}"

    def deployment(self, costs: dict[int, StepCost], transfer: TransferCost | None, kv_bytes_per_token: int,
                   serving: dict[str, dict[str, float]] | None = None, state_bytes: int = 0) -> Deployment:
        """What the simulator runs. `serving`: the profile's serving probe (per kind, the extra time of a
        request, of a decode step and of each decode row; "aggregated@T" for an instance of T threads, where
        the probe measured one); without it the simulator's defaults stand."""
        g = self.generation
        serving = serving or {}
        probe = serving.get(f"{self.kind}@{g.units}") or serving.get(self.kind)
        if probe is None:
            gen_extra: dict = {}
            timing: dict = {}
        else:
            # itl_s was measured on steps of one row, itl_row_s as the slope from there: a step of b rows
            # gets itl_s + (b - 1) x itl_row_s, as the probe saw it at 1 and at ROWS rows.
            row = probe.get("itl_row_s", 0.0)
            gen_extra = {"step_extra_s": max(0.0, probe["itl_s"] - row), "row_extra_s": row}
            timing = {"request_extra_s": probe["ttft_s"], "hop_s": 0.0}
        if self.kind == "aggregated":
            # Served prefill steps as the engine's own timer measured them (serving_probe.py), the rest of the
            # TTFT outside them; from a probe without it, the TTFT's slope is taken as slower prefill steps.
            factor = {}
            if probe and "step_factor" in probe:
                factor = {"prefill_factor": probe["step_factor"]}
                timing["request_extra_s"] = probe["step_ttft_s"]
            elif probe:
                factor = {"prefill_factor": probe.get("prefill_factor", 1.0)}
            inst = SimulatedInstance(costs[g.units], g.max_num_tokens, **gen_extra, **factor, tpot_slo_ms=g.tpot_slo_ms)
            return Deployment("aggregated", [inst] * g.count, **timing)
        # Disaggregated: the context instance steps at the speed its engine timed, as an aggregated one. From a
        # probe without the step timer, the TTFT's slope through the orchestrator is taken as latency outside
        # the context instance's steps (a line through two medians cannot tell the two apart).
        ctx_factor = {}
        if probe and "step_factor" in probe:
            ctx_factor = {"prefill_factor": probe["step_factor"]}
            timing["request_extra_s"] = probe["step_ttft_s"]
        elif probe:
            timing["prefill_extra"] = max(0.0, probe.get("prefill_factor", 1.0) - 1.0)
        gen = [SimulatedInstance(costs[g.units], g.max_num_tokens, **gen_extra)] * g.count
        ctx = [SimulatedInstance(costs[self.context.units], self.context.max_num_tokens, **ctx_factor)] * self.context.count
        return Deployment("disaggregated", gen, ctx, transfer, kv_bytes_per_token, self.schedule_style,
                          self.context.max_num_tokens if self.context.pipelined else None, **timing,
                          state_bytes=state_bytes)

    def cluster_yaml(self, *, model: str | None, backend: str, port: int = 8000, device: str = "cpu") -> dict[str, Any]:
        """The `pdserve launch` config of this deployment: every instance pinned to its own cores."""
        next_core = 0

        def instances(role: Role | None, extra: dict[str, Any]) -> list[dict[str, Any]]:
            nonlocal next_core
            out = []
            for _ in range(role.count if role else 0):
                conf: dict[str, Any] = {"max_num_tokens": role.max_num_tokens, **extra}
                if role.tpot_slo_ms:
                    conf["tpot_slo_ms"] = role.tpot_slo_ms
                spec: dict[str, Any] = {"config": conf}
                if device == "cpu":
                    conf["num_threads"] = role.units
                    spec["cpus"] = list(range(next_core, next_core + role.units))
                next_core += role.units
                if role.pipelined:
                    conf["cache_transceiver_config"] = {"pipelined_transfer": True}
                out.append(spec)
            return out

        doc: dict[str, Any] = {"model": model, "port": port, "backend": backend,
                               "context": instances(self.context, {}),
                               "generation": instances(self.generation, {})}
        if self.schedule_style != "context_first":
            doc["orchestrator"] = {"schedule_style": self.schedule_style}
        return doc


def enumerate_candidates(units: list[int], total: int, input_len: int,
                         tpot_slo_ms: float | None = None) -> list[Candidate]:
    """Every deployment of `total` units (cores or GPUs) from instances of the profiled sizes `units`;
    `tpot_slo_ms`: the SLO's TPOT, for the aggregated instances that budget their prefill by it."""
    out: list[Candidate] = []
    for t in units:
        k = total // t
        if k < 1:
            continue
        for chunk in AGG_CHUNKS:
            if chunk > max(input_len, AGG_CHUNKS[0]) * 2 and chunk != AGG_CHUNKS[0]:
                continue  # a budget past twice the prompt behaves as the one below it
            out.append(Candidate(f"agg{k}x{t}-c{chunk}", "aggregated", Role(k, t, chunk)))
            if tpot_slo_ms:
                out.append(Candidate(f"agg{k}x{t}-c{chunk}-t{tpot_slo_ms:g}", "aggregated",
                                     Role(k, t, chunk, tpot_slo_ms=tpot_slo_ms)))
    whole = max(2048, input_len)
    for tc in units:
        for tg in units:
            for kc in range(1, total // tc + 1):
                rest = total - kc * tc
                if rest < tg or rest % tg:
                    continue
                kg = rest // tg
                base = f"disagg{kc}x{tc}-{kg}x{tg}"
                out.append(Candidate(f"{base}-cf", "disaggregated", Role(kg, tg, 1024), Role(kc, tc, whole)))
                out.append(Candidate(f"{base}-gf", "disaggregated", Role(kg, tg, 1024),
                                     Role(kc, tc, GF_CHUNK, pipelined=True), schedule_style="generation_first"))
    return out
