"""Mamba2's chunked scan against the recurrence it rewrites, token by token."""

from __future__ import annotations

import pytest
import torch

from pdserve.models.mamba2 import CHUNK, ssd


def _stepwise(x, dt, a, b, c, state):
    ys = []
    for t in range(x.shape[0]):
        state = state * (dt[t] * a).exp()[:, None, None] + (dt[t, :, None] * x[t])[:, :, None] * b[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, c[t]))
    return torch.stack(ys), state


@pytest.mark.parametrize("n", [1, 2, CHUNK, CHUNK + 1, 2 * CHUNK + 26])
@pytest.mark.parametrize("dt_scale", [0.01, 0.5, 20.0], ids=["long memory", "decay", "near-total forgetting"])
def test_chunks_give_the_recurrences_outputs_and_state(n, dt_scale):
    g = torch.Generator().manual_seed(n)
    heads, p, s = 4, 8, 16
    x, b, c = (torch.randn(n, heads, d, generator=g) for d in (p, s, s))
    dt, a = torch.rand(n, heads, generator=g) * dt_scale, -torch.rand(heads, generator=g) * 3
    s0 = torch.randn(heads, p, s, generator=g)
    chunked = s0.clone()
    y = ssd(x, dt, a, b, c, chunked)
    want, state = _stepwise(x, dt, a, b, c, s0)
    # fp32 sums in another order: within a millionth of the outputs' scale (dt up to 20 makes them ~100)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-6 * want.abs().max().item())
    torch.testing.assert_close(chunked, state, rtol=1e-4, atol=1e-6 * state.abs().max().item())
