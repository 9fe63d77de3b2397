"""The native recurrent layers (csrc/recurrent.c) against the mixers' PyTorch path on the same weights and
states: Gated DeltaNet and Mamba2, fp32 and bf16, through one step that mixes a long fresh prompt (several
of the PyTorch path's chunks), a prompt chunk after earlier ones, and decodes, then a batched decode step.
Outputs and both states (conv and SSM) must agree; the greedy tokens of whole models against transformers,
native and PyTorch, are tests/engine/test_engine_hybrid.py's and test_engine_nemotron_h.py's."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels import recurrent
from pdserve.models.shapes import LinearAttentionShape, Mamba2Shape
from pdserve.models.gated_deltanet import GatedDeltaNet, deltanet_state
from pdserve.models.mamba2 import Mamba2Mixer, mamba2_state
from pdserve.models.recurrent_state import RecurrentState, StateSlice
from pdserve.parallel.state import ParallelState

pytestmark = pytest.mark.skipif(recurrent.load() is None, reason="no C compiler: the native kernels")

HIDDEN, SLOTS = 96, 6


def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0, math.log(16), generator=g))
            elif "norm" in name or name == "D":
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def _deltanet(dtype):
    shape = LinearAttentionShape(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=24, conv_kernel=4)
    layer = GatedDeltaNet(shape, HIDDEN, 1e-6, ParallelState(), dtype)
    return layer, deltanet_state(shape, 1, dtype.itemsize)


def _mamba2(dtype):
    shape = Mamba2Shape(num_heads=6, head_dim=16, n_groups=2, state_size=12, conv_kernel=4, conv_bias=True,
                        time_step_min=0.001)
    layer = Mamba2Mixer(shape, HIDDEN, 1e-5, ParallelState(), dtype)
    return layer, mamba2_state(shape, 1, dtype.itemsize)


def _steps():
    """(rows, seqs) of two steps over slots 4, 1, 0, 3: first a 150-token fresh prompt, a 5-token chunk of a
    prompt already begun, a decode, a one-token fresh prompt; then one token of each (a decode step)."""
    first = [StateSlice(0, 150, True, 4), StateSlice(150, 5, False, 1), StateSlice(155, 1, False, 0),
             StateSlice(156, 1, True, 3)]
    second = [StateSlice(i, 1, False, slot) for i, slot in enumerate((4, 1, 0, 3))]
    return [(157, first), (4, second)]


def _run(make, dtype, native: bool, monkeypatch):
    layer, geometry = make(dtype)
    _randomise(layer, 0)
    state = RecurrentState(geometry, 2, SLOTS, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    state.conv.copy_(torch.randn(state.conv.shape, generator=g))  # slots 0 and 1 carry earlier tokens
    state.ssm.copy_(0.3 * torch.randn(state.ssm.shape, generator=g))
    with monkeypatch.context() as m:
        if not native:
            m.setattr(recurrent, "load", lambda: None)
        outs = [layer(torch.randn(rows, HIDDEN, generator=g).to(dtype), state, 1, seqs) for rows, seqs in _steps()]
    return outs, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("make", [_deltanet, _mamba2], ids=["deltanet", "mamba2"])
def test_native_layer_equals_the_pytorch_path(make, dtype, monkeypatch):
    (native, ns), (torch_outs, ts) = _run(make, dtype, True, monkeypatch), _run(make, dtype, False, monkeypatch)
    # bf16: the outputs PyTorch rounds to bf16 are rounded here too, so they differ by a rounding or two
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.016, "atol": 0.01}
    for ours, theirs in zip(native, torch_outs):
        assert ours.dtype == dtype and ours.shape == theirs.shape
        torch.testing.assert_close(ours.float(), theirs.float(), **tol)
    torch.testing.assert_close(ns.ssm, ts.ssm, rtol=1e-4, atol=1e-4)  # fp32 in both dtypes
    assert torch.equal(ns.conv, ts.conv)  # the kept conv inputs are copies: exact
    assert torch.equal(ns.ssm[:, 0], ts.ssm[:, 0])  # layer 0 untouched
    assert torch.equal(ns.ssm[[2, 5]], ts.ssm[[2, 5]])  # slots no sequence has


@pytest.mark.parametrize("make", [_deltanet, _mamba2], ids=["deltanet", "mamba2"])
def test_a_slot_outside_the_pool_is_refused_not_written(make):
    layer, geometry = make(torch.float32)
    _randomise(layer, 0)
    state = RecurrentState(geometry, 1, SLOTS, torch.float32, torch.device("cpu"))
    before = state.ssm.clone()
    with pytest.raises(IndexError, match=f"pool of {SLOTS} slots"):
        layer(torch.randn(2, HIDDEN), state, 0, [StateSlice(0, 1, True, 0), StateSlice(1, 1, True, SLOTS)])
    assert torch.equal(state.ssm, before)
