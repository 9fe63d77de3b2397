"""The planner's simulator against the engine's own scheduler, and its goodput search against brute force.

The cost model is built from hand-written step timings (the profile's shape): these tests are about
the simulation's policy and arithmetic, not about this machine's speed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.sweep import distserve_goodput
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sampler import SampleResult
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import RequestType, Sequence
from pdserve.plan.candidates import enumerate_candidates
from pdserve.plan.costmodel import StepCost, TransferCost
from pdserve.plan.planner import PlanSLO, attainment, search_goodput
from pdserve.plan.profile import StepTimings
from pdserve.plan.serving_probe import ROWS
from pdserve.plan.simulate import (
    Deployment,
    SimulatedInstance,
    Workload,
    run_instance,
    simulate,
)


def timings(threads: int = 1) -> StepTimings:
    """Prefill ~1 ms per token plus a quadratic part; decode 10 ms + 1 ms per sequence + KV reads."""
    prefill = {n: 0.001 * n + 1e-7 * n * n / 2 for n in (16, 64, 128, 256, 512, 1024, 2048)}
    decode = {(b, c): 0.010 + 0.001 * b + 2e-6 * b * c for b in (1, 2, 4, 8, 16, 32) for c in (128, 1024)}
    chunk, offset = 512, 1536
    return StepTimings(threads, prefill, (chunk, offset, prefill[512] + 1e-7 * chunk * offset), decode)


@pytest.fixture(scope="module")
def cost() -> StepCost:
    return StepCost(timings())


def test_cost_model_recovers_the_timings_it_was_built_from(cost):
    assert cost.prefill(512) == pytest.approx(0.001 * 512 + 1e-7 * 512 * 512 / 2)
    assert cost.alpha == pytest.approx(1e-7)
    assert cost.beta == pytest.approx(2e-6)
    assert cost.decode(8, 8 * 1024) == pytest.approx(0.010 + 0.008 + 2e-6 * 8 * 1024)
    assert cost.decode(3, 300) == pytest.approx(0.013 + 2e-6 * 300)  # between measured batch sizes
    # A mixed step is one forward over every row, plus both attentions.
    assert cost.step([(256, 512)], 4, 4000) == pytest.approx(cost.prefill(260) + 1e-7 * 256 * 512 + 2e-6 * 4000)
    assert cost.step([], 0, 0) == 0.0


def test_transfer_cost_is_the_least_squares_line():
    t = TransferCost([(1 << 20, 0.001 + 1e-9 * (1 << 20)), (16 << 20, 0.001 + 1e-9 * (16 << 20)),
                      (64 << 20, 0.001 + 1e-9 * (64 << 20))])
    assert t.fixed == pytest.approx(0.001)
    assert t.gb_per_s == pytest.approx(1.0)


def scheduler_times(cost: StepCost, arrivals: np.ndarray, prompt: int, outputs: int, budget: int,
                    max_seqs: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """The real Scheduler stepped in simulated time with the same step costs: first and last token times."""
    s = Scheduler(BlockManager(4096, 16, enable_prefix_caching=False), max_seqs, budget, True)
    n = len(arrivals)
    first, last = np.full(n, math.nan), np.full(n, math.nan)
    t, nxt, done = 0.0, 0, 0
    while done < n:
        while nxt < n and arrivals[nxt] <= t:
            s.add(Sequence(str(nxt), [5] * prompt, SamplingParams(max_tokens=outputs, ignore_eos=True),
                           RequestType.CONTEXT_AND_GENERATION))
            nxt += 1
        if not s.has_work():
            t = float(arrivals[nxt])
            continue
        batch = s.schedule()
        chunks = [(b.num_new_tokens, b.start) for b in batch if b.start < prompt]
        decodes = [b for b in batch if b.start >= prompt]
        t += cost.step(chunks, len(decodes), sum(b.start + 1 for b in decodes)) + 0.0005  # reads start + 1 tokens
        sampling = [b for b in batch if b.samples]
        s.postprocess(batch, SampleResult([7] * len(sampling), [None] * len(sampling), [None] * len(sampling)))
        for out in s.take_outputs():
            i = int(out.request_id)
            if math.isnan(first[i]):
                first[i] = t
            if out.finished:
                last[i] = t
                done += 1
    return first, last


@pytest.mark.parametrize("prompt,outputs,budget,rate", [(300, 8, 128, 2.0), (100, 16, 1024, 5.0), (600, 4, 256, 0.5),
                                                        (256, 32, 512, 1.5)])  # the last leaves slivers
def test_an_instance_steps_as_the_engines_scheduler_does(cost, prompt, outputs, budget, rate):
    arrivals = Workload(prompt, outputs, 40, seed=3).arrivals(rate)
    want_first, want_last = scheduler_times(cost, arrivals, prompt, outputs, budget)
    first, last = run_instance(SimulatedInstance(cost, budget), arrivals, prompt, outputs)
    np.testing.assert_allclose(first, want_first, rtol=1e-9)
    np.testing.assert_allclose(last, want_last, rtol=1e-9)


def test_one_request_alone_costs_its_steps(cost):
    wl = Workload(512, 5, num_requests=10)
    dep = Deployment("aggregated", [SimulatedInstance(cost, 256, step_extra_s=0.0)], request_extra_s=0.1)
    out = simulate(dep, wl, rate=1e-4)  # arrivals hours apart: nobody waits
    prefill = cost.prefill(256) + cost.prefill(256) + cost.alpha * 256 * 256  # two chunks of 256
    np.testing.assert_allclose(out.ttft, prefill + 0.1)
    decode = np.mean([cost.decode(1, 512 + k) for k in range(1, 5)])
    np.testing.assert_allclose(out.tpot, decode)


def test_the_simulated_arrivals_are_the_bench_s_own():
    """Same seed, same request times as `pdserve bench`: a prediction can replay a measured sweep."""
    want = arrival_offsets(30, 2.5, seed=1000)
    np.testing.assert_array_equal(Workload(256, 32, 30, seed=1000).arrivals(2.5), want)
    assert not np.array_equal(Workload(256, 32, 30, seed=1001).arrivals(2.5), want)


def test_each_decode_row_adds_its_serving_time(cost):
    plain, rowed = SimulatedInstance(cost, 256, step_extra_s=0.0), SimulatedInstance(cost, 256, step_extra_s=0.0,
                                                                            row_extra_s=0.002)
    for batch in (1, 4, 16):
        extra = rowed.step_seconds([], batch, 100 * batch) - plain.step_seconds([], batch, 100 * batch)
        assert extra == pytest.approx(0.002 * batch)


def test_a_planned_instance_adds_what_the_serving_probe_measured(cost):
    """The probe read itl_s on steps of one decode row and itl_row_s as the slope up to ROWS rows: the
    simulated instance adds exactly that at 1 and at ROWS rows."""
    probe = {"ttft_s": 0.0, "itl_s": 0.004, "itl_row_s": 0.001, "prefill_factor": 1.0}
    cand = next(c for c in enumerate_candidates([1], 1, input_len=256) if c.kind == "aggregated")
    inst = cand.deployment({1: cost}, None, 0, {"aggregated": probe}).instances[0]
    for rows, extra in ((1, 0.004), (ROWS, 0.004 + (ROWS - 1) * 0.001)):
        bare = cost.step([], rows, 100 * rows)
        assert inst.step_seconds([], rows, 100 * rows) - bare == pytest.approx(extra)


def test_an_instance_of_t_threads_takes_the_probe_of_its_own_size(cost):
    """The probe measures a bigger instance on its own ("aggregated@2"): its threads share the cores with the
    server's. A 2-thread candidate takes those figures, a 1-thread one the one-thread figures, and a size the
    probe did not measure falls back to them too."""
    one = {"ttft_s": 0.010, "itl_s": 0.0, "itl_row_s": 0.0, "prefill_factor": 1.0}
    two = {"ttft_s": 0.060, "itl_s": 0.008, "itl_row_s": 0.001, "prefill_factor": 1.2}
    costs = {1: cost, 2: StepCost(timings(2)), 4: StepCost(timings(4))}
    cands = [c for c in enumerate_candidates([1, 2, 4], 4, input_len=256) if c.kind == "aggregated"]
    by_units = {c.generation.units: c for c in cands if not c.generation.tpot_slo_ms}
    serving = {"aggregated": one, "aggregated@2": two}
    for units, probe in ((1, one), (2, two), (4, one)):
        dep = by_units[units].deployment(costs, None, 0, serving)
        inst = dep.instances[0]
        assert dep.request_extra_s == probe["ttft_s"] and inst.prefill_factor == probe["prefill_factor"]
        assert inst.step_extra_s + inst.row_extra_s == pytest.approx(probe["itl_s"])


def test_an_aggregated_instance_steps_at_the_speed_its_engine_timed(cost):
    """Two TTFT medians put a line with slope 0.83 through a 2-thread bf16 server whose own prefill steps ran
    at 1.0-1.25x the bare ones: simulated on the slope, its steps were too short, and the plan over-predicted
    aggregated goodput up to 2.7x. The probe now reads the engine's step timer; an aggregated candidate steps
    at that speed and keeps the rest of the TTFT as latency outside the steps."""
    from pdserve.plan.serving_probe import _affine, _by_steps

    n_lo, n_hi = 128, 512
    step = {n_lo: 1.05 * cost.prefill(n_lo), n_hi: 1.05 * cost.prefill(n_hi)}
    ttft = {n_lo: step[n_lo] + 0.055, n_hi: step[n_hi] + 0.014}  # the server's fixed cost moved between them
    probe = {**_affine(ttft, cost), **_by_steps(ttft, step, cost), "itl_s": 0.0, "itl_row_s": 0.0}
    assert probe["prefill_factor"] < 1.0  # the line's slope: faster than bare, which no served step is
    assert probe["step_factor"] == pytest.approx(1.05)
    assert probe["step_ttft_s"] == pytest.approx((0.055 + 0.014) / 2)
    cand = next(c for c in enumerate_candidates([1], 1, input_len=256) if c.kind == "aggregated")
    dep = cand.deployment({1: cost}, None, 0, {"aggregated": probe})
    assert dep.instances[0].prefill_factor == pytest.approx(1.05)
    assert dep.request_extra_s == pytest.approx(probe["step_ttft_s"])
    alone = simulate(dep, Workload(256, 4, num_requests=5), rate=1e-4)
    np.testing.assert_allclose(alone.ttft, probe["step_ttft_s"] + 1.05 * cost.prefill(256)
                               + dep.instances[0].step_extra_s, rtol=1e-6)


def test_a_context_instance_steps_at_the_speed_its_engine_timed(cost):
    """As an aggregated instance: a disaggregated candidate's context instance steps at the probe's
    step_factor, the rest of the TTFT outside its steps. Before, the line's slope through the orchestrator
    was all latency outside the steps, so a context instance near its capacity queued too little: replaying
    an fp32 sweep, the plan gave 1+1 cores 0.5 req/s within a 1 s TTFT where none was measured."""
    from pdserve.plan.serving_probe import _affine, _by_steps

    n_lo, n_hi = 128, 512
    step = {n: 1.3 * cost.prefill(n) for n in (n_lo, n_hi)}
    ttft = {n_lo: step[n_lo] + 0.03, n_hi: step[n_hi] + 0.01}
    probe = {**_affine(ttft, cost), **_by_steps(ttft, step, cost), "itl_s": 0.0, "itl_row_s": 0.0}
    cand = next(c for c in enumerate_candidates([1], 2, input_len=256) if c.kind == "disaggregated")
    transfer = TransferCost([(1, 0.001), (10**9, 1.001)])
    dep = cand.deployment({1: cost}, transfer, 1000, {"disaggregated": probe})
    assert dep.context[0].prefill_factor == pytest.approx(1.3) and dep.prefill_extra == 0.0
    assert dep.request_extra_s == pytest.approx(0.02)
    # at capacity the slower steps queue: a burst of 6 prompts waits 1.3x as long behind them
    burst = Workload(256, 4, num_requests=6)
    slow = simulate(dep, burst, rate=1e4)
    bare = simulate(cand.deployment({1: cost}, transfer, 1000, {"disaggregated": {**probe, "step_factor": 1.0}}),
                    burst, rate=1e4)
    assert slow.ttft.max() - bare.ttft.max() == pytest.approx(0.3 * 6 * cost.prefill(256), rel=0.2)


def test_disaggregated_ttft_holds_the_transfer_and_decode_is_never_behind_a_prefill(cost):
    transfer = TransferCost([(1, 0.01), (10**9, 1.01)])  # 10 ms + 1 GB/s
    wl = Workload(1024, 8, num_requests=30)
    gen, ctx = SimulatedInstance(cost, 1024, step_extra_s=0.0), SimulatedInstance(cost, 2048, step_extra_s=0.0)
    dep = Deployment("disaggregated", [gen], [ctx], transfer, kv_bytes_per_token=1000, hop_s=0.004)
    alone = simulate(dep, wl, rate=1e-4)
    np.testing.assert_allclose(alone.ttft, cost.prefill(1024) + 0.004 + transfer.seconds(1024 * 1000))
    busy = simulate(dep, wl, rate=0.8)
    # The generation instance only decodes: its steps never carry a prefill, at any load.
    assert busy.tpot.max() <= cost.decode(30, 30 * (1024 + 8)) + 1e-9


def test_a_hybrid_models_state_moves_once_per_request(cost):
    """The recurrent state is moved whole with the KV: its bytes add to the transfer once, whatever the
    prompt's length."""
    transfer = TransferCost([(1, 0.01), (10**9, 1.01)])
    wl = Workload(1024, 8, num_requests=4)
    gen, ctx = SimulatedInstance(cost, 1024, step_extra_s=0.0), SimulatedInstance(cost, 2048, step_extra_s=0.0)
    dep = Deployment("disaggregated", [gen], [ctx], transfer, kv_bytes_per_token=1000, hop_s=0.004,
                     state_bytes=5_000_000)
    alone = simulate(dep, wl, rate=1e-4)
    np.testing.assert_allclose(alone.ttft, cost.prefill(1024) + 0.004 + transfer.seconds(1024 * 1000 + 5_000_000))


def test_goodput_search_agrees_with_brute_force(cost):
    wl = Workload(512, 16, num_requests=60)
    dep = Deployment("aggregated", [SimulatedInstance(cost, 512)])
    slo = PlanSLO(ttft_ms=1500, tpot_ms=60)
    rates = [0.25 * k for k in range(1, 17)]
    brute = distserve_goodput([(r, attainment(dep, wl, r, slo)[0]) for r in rates])
    assert 0 < brute < rates[-1]
    scored, _ = search_goodput(dep, wl, slo, capacity=4.0, rates=rates)
    assert scored == brute
    searched, _ = search_goodput(dep, wl, slo, capacity=4.0)
    assert brute <= searched < brute + 0.25 + 1e-9  # the search refines between the grid's rates
    assert attainment(dep, wl, searched, slo)[0] >= 0.9


def test_an_slo_no_single_request_meets_has_zero_goodput(cost):
    wl = Workload(1024, 8, num_requests=20)
    dep = Deployment("aggregated", [SimulatedInstance(cost, 1024)])
    good, points = search_goodput(dep, wl, PlanSLO(ttft_ms=100, tpot_ms=100), capacity=1.0)
    assert good == 0.0 and len(points) == 1


@pytest.mark.parametrize("text,error", [("ttft:100", "both"), ("ttft:1,tpot:x", "not a number"),
                                        ("ttft:nan,tpot:5", "positive, finite"), ("tpot:1,tpot:2", "twice"),
                                        ("e2e:5,tpot:1", "not ttft:MS"), ("ttft:-1,tpot:1", "positive")])
def test_a_bad_slo_says_what_to_write(text, error):
    with pytest.raises(ValueError, match=error):
        PlanSLO.parse(text)


def test_a_tpot_budget_trades_ttft_for_tpot_as_the_engine_does(cost):
    """tpot_slo_ms in the simulator: the engine's own policy (step_budget.prefill_allowance) on the
    profile's step costs. Under load it holds TPOT down and pays in TTFT; alone it changes nothing."""
    wl = Workload(512, 32, 60)
    plain = SimulatedInstance(cost, 1024)
    budgeted = SimulatedInstance(cost, 1024, tpot_slo_ms=30)
    lone = [run_instance(spec, np.array([0.0]), 512, 32) for spec in (plain, budgeted)]
    assert lone[0][0] == lone[1][0] and lone[0][1] == lone[1][1]  # nothing decodes beside a lone prompt
    rate = 1.2
    a = simulate(Deployment("aggregated", [plain]), wl, rate)
    b = simulate(Deployment("aggregated", [budgeted]), wl, rate)
    # Chunked prefill alone: 512-token prompts (~0.5 s each here) stall the decodes beside them. With the
    # budget the one-block floor (32 tokens, ~30 ms here) still lets TPOT pass 30 ms, but not by much.
    assert a.percentile("tpot", 90) > 0.100
    assert b.percentile("tpot", 90) < 0.045
    assert b.percentile("ttft", 50) > a.percentile("ttft", 50)
