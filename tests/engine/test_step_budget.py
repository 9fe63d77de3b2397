"""tpot_slo_ms: the prefill a step may take beside decoding requests (engine/step_budget.py).

The policy on its own with step costs given (it learns them from observations, as the engine feeds
it), the scheduler applying it, and a real engine whose greedy output must not change with it."""

from __future__ import annotations

import time

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.llm import LLM
from pdserve.engine.sampler import SampleResult
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_budget import MARGIN, StepTimeModel, TpotBudget, attention_work
from pdserve.testing import make_tiny_model

# A made-up machine: 5 ms a step, 0.5 ms a row, 2 ms per million token pairs of attention.
C0, C1, C2 = 0.005, 0.0005, 0.002


def _cost(rows: int, attention: float) -> float:
    return C0 + C1 * rows + C2 * attention


def _taught(budget: TpotBudget) -> TpotBudget:
    """Feed the budget's model the steps a server would run: prefills and decode batches."""
    for n in (16, 64, 256, 512, 1024) * 2:
        budget.model.observe(n, attention_work([(n, 0)], []), True, _cost(n, attention_work([(n, 0)], [])))
    for b in (1, 2, 4, 8, 16) * 2:
        w = attention_work([], [300] * b)
        budget.model.observe(b, w, False, _cost(b, w))
    return budget


def test_the_model_recovers_a_linear_cost():
    model = _taught(TpotBudget(50, 1024, 16)).model
    assert model.coef == pytest.approx([C0, C1, C2], rel=1e-6)


def test_a_negative_term_is_dropped_not_used_as_a_discount():
    model = StepTimeModel()
    for i in range(40):  # attention grows with rows but the time does not depend on it: noise makes it < 0
        rows = 10 + i
        model.observe(rows, rows * 0.01 + (0.003 if i % 2 else 0), i % 2 == 0, C0 + C1 * rows)
    assert model.coef is not None and (model.coef >= 0).all()


def test_no_limit_until_learnt_or_with_nothing_decoding():
    now = time.monotonic()
    assert TpotBudget(50, 1024, 16).prefill_tokens([(5, 0, now - 0.1, 300)], 0, now) == 1024  # nothing learnt yet
    assert _taught(TpotBudget(50, 1024, 16)).prefill_tokens([], 0, now) == 1024


def test_the_request_with_least_slack_sets_the_budget():
    budget = _taught(TpotBudget(50, 1024, 16))
    tpot = 0.050 * MARGIN
    now = 100.0
    # 10 tokens each and none after this step's, so 10 x tpot of time; a has spent all but 60 ms of it,
    # b all but 160 ms
    a, b = (10, 0, now - 10 * tpot + 0.060, 300), (10, 0, now - 10 * tpot + 0.160, 300)
    n = budget.prefill_tokens([a, b], 0, now)
    allowed = 0.060
    step = lambda k: _cost(2 + k, attention_work([(k, 0)], [300, 300]))  # noqa: E731
    assert step(n) <= allowed < step(n + 1)
    assert budget.prefill_tokens([b], 0, now) > n  # b alone has more slack


def test_a_young_request_lends_the_slack_of_its_future_tokens():
    budget = _taught(TpotBudget(50, 1024, 16))
    tpot, now = 0.050 * MARGIN, 100.0
    decode = _cost(1, attention_work([], [300]))
    last = budget.prefill_tokens([(1, 0, now - 0.02, 300)], 0, now)  # its last token: 25 ms to spend
    young = budget.prefill_tokens([(1, 3, now - 0.02, 300)], 0, now)  # three more to come after it
    step = lambda k: _cost(1 + k, attention_work([(k, 0)], [300]))  # noqa: E731
    assert step(last) <= tpot - 0.02 < step(last + 1)
    assert step(young) <= 4 * tpot - 0.02 - 3 * decode < step(young + 1)
    assert budget.prefill_tokens([(1, 30, now - 0.02, 300)], 0, now) == 1024  # its whole prompt fits


def test_a_request_behind_its_slo_leaves_the_floor():
    budget = _taught(TpotBudget(50, 1024, 16))
    now = 100.0
    late = (4, 20, now - 1.0, 300)  # 4 tokens in 1 s: 250 ms each, and 20 more at most
    assert budget.prefill_tokens([late], 0, now) == 16


def test_the_scheduler_caps_prefill_beside_decodes_and_not_alone():
    budget = _taught(TpotBudget(50, 1024, 16))
    s = Scheduler(BlockManager(128, 16), 8, 1024, True, tpot_budget=budget)
    a = Sequence("a", list(range(1, 33)), SamplingParams(max_tokens=2))  # its next token is its last
    s.add(a)
    [step] = s.schedule()
    assert step.num_new_tokens == 32  # alone: the whole prompt
    s.postprocess([step], SampleResult([7], [None], [None]))
    a.first_token_time = time.monotonic() - 0.01  # 10 ms into its 45 ms budget for the next token
    b = Sequence("b", list(range(1, 1001)), SamplingParams(max_tokens=4))
    s.add(b)
    batch = s.schedule()
    assert [(x.seq.request_id, x.num_new_tokens) for x in batch][0] == ("a", 1)
    chunk = batch[1].num_new_tokens
    assert 16 <= chunk < 1000, chunk
    assert _cost(1 + chunk, attention_work([(chunk, 0)], [33])) <= 0.045 - 0.01 + 0.002  # what a could afford
    unlimited = Scheduler(BlockManager(128, 16), 8, 1024, True)
    unlimited.add(Sequence("c", list(range(1, 1001)), SamplingParams(max_tokens=4)))
    assert unlimited.schedule()[0].num_new_tokens == 1000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", num_layers=2, num_heads=4, num_kv_heads=2)


def test_greedy_output_is_the_same_with_the_budget(tiny):
    """A tight SLO chunks prompts differently; the tokens must not change."""
    prompts = [[(7 * i + j) % 250 + 1 for j in range(40 + 30 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for slo in (None, 0.001):
        cfg = EngineConfig(model=str(tiny), device="cpu", max_model_len=512, num_kv_blocks=128,
                           tokens_per_block=8, max_num_tokens=256, tpot_slo_ms=slo)
        with LLM(cfg) as llm:
            for n in (20, 60, 100, 140, 180):  # steps to learn from: one prefill, then decodes, each
                llm.generate([list(range(1, n + 1))], SamplingParams(max_tokens=5, ignore_eos=True))
            outs[slo] = [c.token_ids for c in llm.generate(prompts, params)]
            if slo is not None:  # 1 us per token: every prompt after the first moved one block a step
                assert llm.engine.tpot_budget.capped_steps > 10
    assert outs[0.001] == outs[None]
