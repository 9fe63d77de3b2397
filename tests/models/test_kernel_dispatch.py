"""The per-machine choice between each native kernel and its PyTorch path (kernels/dispatch.py, raced against
the paths of models/torch_paths.py): timed once and kept, read back, forced by PDSERVE_KERNEL_PATH, and either
way the tokens of transformers.

The suite runs with PDSERVE_KERNEL_PATH=native (tests/conftest.py), so that the tests of the native paths
run them whatever the timing says; these tests set the variable themselves."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pdserve import env
from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels import cpu, dispatch
from pdserve.models import torch_paths
from pdserve.models.layers import _LINEARS
from pdserve.testing import make_tiny_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler to build the CPU kernels")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SHAPE = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}


@pytest.fixture(autouse=True)
def _forget_paths():
    yield
    cpu.reset_paths()  # the choices are process-wide: leave none to the next test


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, hf_greedy):
    d = make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", **SHAPE)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 530)]  # 530: the tiled path's length
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return d, prompts, hf_greedy(model, prompts, GREEDY.max_tokens)


def test_the_forcing_variable_is_read_and_checked():
    both = dict.fromkeys([cpu.FLASH_PREFILL, cpu.PAGED_DECODE, cpu.GEMV, cpu.RMS_NORM, cpu.ROPE_CACHE, cpu.GEMM],
                         False)
    assert dispatch.forced_paths("torch") == both
    assert dispatch.forced_paths("native") == {k: True for k in both}
    assert dispatch.forced_paths("auto") == dispatch.forced_paths("") == {}
    assert dispatch.forced_paths("flash_prefill=torch, gemv=auto") == {cpu.FLASH_PREFILL: False}
    for bad in ("fast", "flash=torch", "gemv=never"):
        with pytest.raises(ValueError, match="PDSERVE_KERNEL_PATH=.*expected auto, native, torch"):
            dispatch.forced_paths(bad)


@pytest.mark.parametrize("races,native", [([(1.0, 2.0)], True), ([(1.0, 0.97)], True),
                                          ([(2.0, 1.0), (1.5, 1.2)], False), ([(2.0, 1.0), (1.1, 1.2)], True)],
                         ids=["native wins", "a tie", "torch wins twice", "torch wins once"])
def test_pytorch_is_chosen_only_where_it_wins_two_races(tmp_path, races, native):
    """A busy spell of the machine can make one race go to PyTorch; the choice (and the times kept) is
    the second race's then. Within 5% (TIE) a race is the native path's."""
    times = iter(races)
    cache = tmp_path / "choices.json"
    assert dispatch._decide("gemv", torch.float32, "t", lambda: next(times), {}, cache) == native
    (entry,) = json.loads(cache.read_text()).values()
    assert entry == {"native": native, "native_ms": races[-1][0], "torch_ms": races[-1][1]}
    assert next(times, None) is None  # the second race only where the first went to PyTorch


def test_a_race_one_side_leads_by_far_ends_after_one_turn():
    """Five turns each where the two are close; one (after the warm-up call) where a side is LEAD times
    slower, so a slow PyTorch path is not paid for five times at a first start."""
    import time

    for native_s, reference_s, calls in [(0.001, 0.06, 2), (0.02, 0.02, 6)]:
        counts = [0, 0]

        def run(i, seconds):
            counts[i] += 1
            time.sleep(seconds)
        native_ms, reference_ms = dispatch._race(lambda: run(0, native_s), lambda: run(1, reference_s))
        assert counts == [calls, calls]
        assert native_ms >= native_s * 1e3 and reference_ms >= reference_s * 1e3


def test_the_choice_is_timed_once_kept_and_read_back(tiny, tmp_path, monkeypatch, caplog):
    """The first start times both paths and keeps the times and the choice in the cache; the next reads
    them back without timing (shown by a stored choice, flipped by hand, being the one taken)."""
    d, _, _ = tiny
    monkeypatch.setenv(env.KERNEL_PATH, "auto")
    monkeypatch.setattr(dispatch, "FLASH_TOKENS", 256)  # shorter timings: the test is of the keeping
    monkeypatch.setattr(dispatch, "PAGED_DECODE_CASES", ((1, 256), (4, 64)))
    monkeypatch.setattr(dispatch, "STEP_ROWS", (1, 16))
    cache = tmp_path / "choices.json"
    with LLM(EngineConfig(model=str(d), device="cpu", tokens_per_block=8)) as llm:
        model = llm.engine.runner.model
        heads = (SHAPE["num_heads"], SHAPE["num_kv_heads"], SHAPE["head_dim"])
        with caplog.at_level(logging.INFO, logger=dispatch.__name__):
            first = torch_paths.choose_paths(model, torch.float32, *heads, cache=cache)
        assert set(first) == set(dispatch.KERNELS) - {cpu.GEMM}  # (bf16 only)
        assert caplog.text.count("(timed: native") == 5, caplog.text
        stored = json.loads(cache.read_text())
        assert len(stored) == 5
        for entry in stored.values():
            times = (entry["native_ms"], entry["torch_ms"])  # (within TIE a race is native's)
            assert entry["native"] == (not dispatch._torch_wins(times)) and entry["native_ms"] > 0
        (flash_key,) = [key for key in stored if f"|{cpu.FLASH_PREFILL}|float32|4x2x16@256" in key]
        stored[flash_key]["native"] = not first[cpu.FLASH_PREFILL]
        cache.write_text(json.dumps(stored))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=dispatch.__name__):
            again = torch_paths.choose_paths(model, torch.float32, *heads, cache=cache)
        assert caplog.text.count("(cached: native") == 5 and "timed" not in caplog.text, caplog.text
        assert again == {**first, cpu.FLASH_PREFILL: not first[cpu.FLASH_PREFILL]}
        assert cpu.native(cpu.FLASH_PREFILL, torch.float32) == again[cpu.FLASH_PREFILL]


@pytest.mark.parametrize("path", ["native", "torch"])
def test_each_forced_path_gives_transformers_tokens(tiny, monkeypatch, path):
    """Forced to PyTorch, no native attention, GEMV, RMSNorm or RoPE / cache write runs (the plain weight
    copies and the C decode step are gone); forced native, they do. Both give transformers' greedy tokens."""
    d, prompts, ref = tiny
    monkeypatch.setenv(env.KERNEL_PATH, path)
    gemv_runs = cpu.skinny_linear_runs()  # (a trial call: before the calls are counted)
    calls = []
    for name in ("flash_prefill", "paged_decode_attention", "skinny_linear", "rms_norm", "rope_cache_write"):
        kernel = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    with LLM(EngineConfig(model=str(d), device="cpu", tokens_per_block=8, max_num_seqs=1)) as llm:
        model = llm.engine.runner.model
        gemv_weights = [m.gemv_weight for m in model.modules() if isinstance(m, _LINEARS)]
        calls.clear()  # (the dispatch's own trial calls)
        assert [c.token_ids for c in llm.generate(prompts, GREEDY)] == ref
    native = path == "native"
    assert cpu.native(cpu.FLASH_PREFILL, torch.float32) == native
    assert ("flash_prefill" in calls) == native
    assert ("rms_norm" in calls) == native and ("rope_cache_write" in calls) == native  # (prefills: no C step)
    assert native or "paged_decode_attention" not in calls  # (native, the C decode step runs it)
    if gemv_runs:
        assert all(w is not None for w in gemv_weights) == native and (model.stage_decoder is not None) == native
        assert native or "skinny_linear" not in calls


def test_an_mla_model_races_no_attention_kernel(tmp_path, monkeypatch):
    """DeepSeek-V3 attends over its latents with SDPA (mla.py), never through flash prefill or paged decode:
    its start decides (and would time) neither, only the GEMV of its linears."""
    from pdserve.engine import model_runner
    from pdserve.testing.tiny_deepseek_v3 import make_tiny_deepseek_v3

    decided = []
    monkeypatch.setattr(model_runner, "choose_paths",
                        lambda *a, **k: decided.append(torch_paths.choose_paths(*a, **k)) or decided[-1])
    with LLM(EngineConfig(model=str(make_tiny_deepseek_v3(tmp_path / "m", num_layers=2)))):
        pass
    assert len(decided) == 1
    assert cpu.FLASH_PREFILL not in decided[0] and cpu.PAGED_DECODE not in decided[0], decided


def test_ranks_storing_choices_at_once_keep_every_entry(tmp_path):
    """The ranks of a TP instance time and store their choices at the same moment: each entry survives
    (before, each rank read the file, added its entry and renamed its copy over it, and the last rename
    dropped the others' entries), and the file is whole JSON throughout."""
    import threading

    cache = tmp_path / "choices.json"
    seen_broken = []

    def rank(r: int) -> None:
        for i in range(25):
            dispatch._store_choice(cache, f"rank{r}|{i}", {"native": True, "native_ms": 1.0, "torch_ms": 2.0})
            if cache.exists() and not dispatch._load_choices(cache):
                seen_broken.append(r)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(json.loads(cache.read_text())) == 100 and not seen_broken
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
