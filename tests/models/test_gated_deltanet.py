"""The gated delta rule's chunked form against the recurrence it rewrites, token by token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.models.gated_deltanet import CHUNK, delta_rule, delta_rule_stepwise


def _inputs(n: int, heads: int = 4, dk: int = 8, dv: int = 6, seed: int = 0, decay: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(n, heads, dk, generator=g), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(n, heads, dk, generator=g), dim=-1)
    v = torch.randn(n, heads, dv, generator=g)
    return q, k, v, -torch.rand(n, heads, generator=g) * decay, torch.rand(n, heads, generator=g), \
        torch.randn(heads, dk, dv, generator=g)


@pytest.mark.parametrize("n", [2, 7, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
@pytest.mark.parametrize("decay", [0.01, 2.0, 30.0], ids=["slow decay", "decay", "near-total forgetting"])
def test_chunks_give_the_recurrences_outputs_and_state(n, decay):
    q, k, v, g, beta, s0 = _inputs(n, decay=decay)
    chunked, stepwise = s0.clone(), s0.clone()
    out = delta_rule(q, k, v, g, beta, chunked)
    want = delta_rule_stepwise(q, k, v, g, beta, stepwise)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, stepwise, rtol=1e-5, atol=1e-5)


def test_a_prompt_in_pieces_leaves_the_state_the_whole_prompt_leaves():
    q, k, v, g, beta, s0 = _inputs(100)
    whole, pieces = s0.clone(), s0.clone()
    out = delta_rule(q, k, v, g, beta, whole)
    parts = [delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], pieces) for a, b in ((0, 1), (1, 30), (30, 100))]
    torch.testing.assert_close(torch.cat(parts), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-5)
