"""The plan's KV transfer table comes from the real write planner: every destination byte has one owner."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.bounce import BounceConfig
from pdserve.plan.transfer import Layout, format_transfer_plan, transfer_plan

SMOLLM2 = {"num_layers": 30, "kv_heads": 3, "head_dim": 64, "element_bytes": 4}
PER_TOKEN = 30 * 2 * 3 * 64 * 4


@pytest.mark.parametrize("ctx,gen", [("tp1", "tp1"), ("tp3", "pp2"), ("tp1", "tp3"), ("tp3pp2", "tp1"),
                                     ("pp3", "tp3pp2"), ("tp6", "tp1")])
def test_each_generation_byte_is_written_once(ctx, gen):
    c, g = Layout.parse(ctx), Layout.parse(gen)
    rows = transfer_plan(c, g, prompt_tokens=1000, **SMOLLM2)
    assert len(rows) == c.tp * c.pp * g.tp * g.pp
    padded = 32 * 32  # 1000 tokens in 32-token blocks
    heads_held = max(g.tp, 3)  # gen ranks beyond the 3 heads hold a copy each
    assert sum(r.nbytes for r in rows) == padded * PER_TOKEN * heads_held // 3
    for gen_rank in range(g.tp * g.pp):
        owners = [r for r in rows if r.gen_rank == gen_rank and r.owner]
        assert owners and all(r.descriptors > 0 for r in owners)
    if c.tp > 3:  # head duplication on the context side: one replica writes, the other does not
        assert any(not r.owner for r in rows)


def test_an_intact_pair_is_one_direct_descriptor_and_a_head_split_is_many():
    [one] = transfer_plan(Layout(), Layout(), prompt_tokens=1024, **SMOLLM2)
    assert (one.owner, one.descriptors, one.nbytes, one.path) == (True, 1, 1024 * PER_TOKEN, "direct")
    split = transfer_plan(Layout(), Layout(tp=3), prompt_tokens=4096, kv_layout="NHD", **SMOLLM2)
    assert all(r.descriptors == 4096 * 30 * 2 for r in split)  # one per token, layer and K/V
    bounced = transfer_plan(Layout(), Layout(tp=3), prompt_tokens=4096, kv_layout="NHD", bounce=BounceConfig(),
                            **SMOLLM2)
    assert [r.path for r in bounced] == ["bounce"] * 3
    text = format_transfer_plan(Layout(), Layout(tp=3), split, 4096, None)
    assert "bounce.enabled: true" in text and "180.00 MiB" in text


@pytest.mark.parametrize("text,error", [("tp0", "look like"), ("dp2", "look like"), ("tp2x", "look like")])
def test_a_bad_layout_says_how_to_write_one(text, error):
    with pytest.raises(ValueError, match=error):
        Layout.parse(text)


def test_a_layout_the_model_cannot_take_is_refused():
    with pytest.raises(ValueError, match="one must divide the other"):
        transfer_plan(Layout(tp=2), Layout(), prompt_tokens=64, **SMOLLM2)


@pytest.mark.parametrize("ctx,gen", [("tp2", "tp1"), ("tp1", "tp2"), ("tp2", "tp4"), ("tp2", "pp2")])
def test_an_mla_latent_pool_is_replicated_and_each_generation_rank_has_one_writer(ctx, gen):
    """DeepSeek-V3's tiny geometry: 3 layers of a 40-wide latent (one "head"), the same on every context TP
    rank. Each generation rank takes its whole share from exactly one context rank."""
    c, g = Layout.parse(ctx), Layout.parse(gen)
    rows = transfer_plan(c, g, prompt_tokens=100, num_layers=3, kv_heads=1, head_dim=40, element_bytes=2, latent=True)
    padded = 128  # 100 tokens in 32-token blocks
    assert sum(r.nbytes for r in rows) == padded * 3 * 40 * 2 * g.tp  # every gen TP rank keeps the whole latent
    for gen_rank in range(g.tp * g.pp):
        owners = [r for r in rows if r.gen_rank == gen_rank and r.owner]
        assert len(owners) == 1 and owners[0].pool == "REPLICATED"
    text = format_transfer_plan(c, g, rows, 100, None)
    assert "REPLICATED" in text and "one elected context rank" in text


def test_on_a_gpu_a_short_nhd_prompt_is_one_descriptor_per_pair():
    """A GPU pays per descriptor, so the bounce path takes a 512-token NHD request there (on the host
    its block gate sends it direct); `written` is what the agent writes."""
    args = dict(num_layers=30, kv_heads=3, head_dim=64, element_bytes=2, prompt_tokens=512, kv_layout="NHD",
                bounce=BounceConfig())
    host = transfer_plan(Layout(), Layout(tp=3), **args)
    gpu = transfer_plan(Layout(), Layout(tp=3), on_device=True, **args)
    assert [(r.path, r.descriptors, r.written) for r in host] == [("direct", 30720, 30720)] * 3
    assert [(r.path, r.descriptors, r.written) for r in gpu] == [("bounce", 30720, 1)] * 3
    assert "per request: 92160 fragments, 3 descriptors written" in format_transfer_plan(
        Layout(), Layout(tp=3), gpu, 512, BounceConfig())


def test_pdserve_plan_takes_the_kv_layout_and_the_profile_device():
    """`pdserve plan --ctx-layout tp1 --gen-layout tp3 [--kv-layout NHD] [--bounce]`: the transfer section
    of a GPU profile stages an NHD request into one descriptor per pair, a CPU profile's does not."""
    from types import SimpleNamespace

    from pdserve.plan.cli import build_parser
    from pdserve.plan.run import layout_transfer

    model = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "element_bytes": 2}
    args = build_parser().parse_args(["--slo", "ttft:1000,tpot:100", "--input-len", "512", "--ctx-layout", "tp1",
                                      "--gen-layout", "tp3", "--kv-layout", "NHD", "--bounce"])
    for device, written in (("cuda", 1), ("cpu", 30720)):
        _, _, rows, _ = layout_transfer(args, SimpleNamespace(model=model, key={"device": device}))
        assert [(r.descriptors, r.written) for r in rows] == [(30720, written)] * 3
