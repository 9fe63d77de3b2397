"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5's recurrent layers.

Each value head keeps a state S: [k_head_dim, v_head_dim] (fp32) that every token updates and reads:

    S <- exp(g) * S                          decay (g < 0, from the token's `a` projection)
    S <- S + k (beta * (v - S^T k))^T         the delta rule: move S's answer for k toward v
    o  = S^T q                                q and k L2-normalised, q scaled by k_head_dim^-0.5

Before the rule, [q | k | v] pass a depthwise causal conv of `conv_kernel` taps, so a sequence also
keeps its last conv_kernel - 1 conv inputs. Both live in `RecurrentState` (recurrent_state.py), one slot
per running sequence.

Tensor parallelism cuts by heads: [q | k | v] section by section (key heads, key heads, value heads),
and each value head stays with the key head it reads (value head j reads key head
j // (num_v_heads // num_k_heads), and both cuts are contiguous).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.shapes import LinearAttentionShape
from pdserve.kernels import recurrent
from pdserve.models.layers import MergedColumnParallelLinear, RowParallelLinear, _shard
from pdserve.models.recurrent_state import (RecurrentState, StateGeometry, StateSlice, causal_conv, causal_conv_step,
                                           decode_slots)
from pdserve.parallel.state import ParallelState


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


CHUNK = 64  # tokens the chunked form takes at once


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over one sequence's tokens, updating `state` in place: token by token for a
    decode step, in chunks of CHUNK tokens for a prefill (`delta_rule_chunk`, the same sums).

    q, k: [n, v_heads, k_dim] fp32 (normalised, q scaled); v: [n, v_heads, v_dim] fp32; g, beta:
    [n, v_heads] fp32; state: [v_heads, k_dim, v_dim] fp32. Returns o: [n, v_heads, v_dim] fp32."""
    if q.shape[0] == 1:
        return delta_rule_stepwise(q, k, v, g, beta, state)
    return torch.cat([delta_rule_chunk(q[i:i + CHUNK], k[i:i + CHUNK], v[i:i + CHUNK], g[i:i + CHUNK],
                                       beta[i:i + CHUNK], state) for i in range(0, q.shape[0], CHUNK)])


def delta_rule_stepwise(q, k, v, g, beta, state):
    """`delta_rule` as the recurrence reads, one token at a time (decode steps; the tests' reference)."""
    out = torch.empty_like(v)
    s = state
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        remembered = torch.einsum("hkv,hk->hv", s, k[t])
        s = s + k[t][:, :, None] * ((v[t] - remembered) * beta[t][:, None])[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    state.copy_(s)
    return out


def delta_rule_chunk(q, k, v, g, beta, state):
    """`delta_rule` over c tokens at once. With G_t = g_1 + ... + g_t (log decays so far), the state after
    token t is

        S_t = e^{G_t} S_0 + sum_{i<=t} e^{G_t - G_i} k_i u_i^T

    where u_t is what token t writes: u_t = beta_t (v_t - e^{G_t} S_0^T k_t - sum_{i<t} e^{G_t - G_i} (k_t.k_i) u_i),
    a unit lower-triangular system (I + diag(beta) A) U = diag(beta) (V - diag(e^G) K S_0) with
    A_ti = e^{G_t - G_i} k_t.k_i for i < t. Then o_t = S_t^T q_t:

        O = diag(e^G) Q S_0 + (M * Q K^T) U,   M_ti = e^{G_t - G_i} for i <= t, else 0

    and S_c = e^{G_c} S_0 + K^T diag(e^{G_c - G}) U. Every exponent is <= 0 (g < 0): nothing overflows."""
    c = q.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, c, dim]
    G = g.t().cumsum(-1)  # [heads, c]
    b = beta.t().unsqueeze(-1)  # [heads, c, 1]
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)  # [heads, c, c]: G_t - G_i
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal, diff, float("-inf")).exp()  # M, [heads, c, c]
    strict = (decay * (kh @ kh.transpose(1, 2))).tril(-1)  # A
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    rhs = b * (vh - G.exp().unsqueeze(-1) * (kh @ state))
    u = torch.linalg.solve_triangular(eye + b * strict, rhs, upper=False, unitriangular=True)
    out = G.exp().unsqueeze(-1) * (qh @ state) + (decay * (qh @ kh.transpose(1, 2))) @ u
    last = G[:, -1:]  # [heads, 1]
    state.mul_(last.exp().unsqueeze(-1)).add_(kh.transpose(1, 2) @ ((last - G).exp().unsqueeze(-1) * u))
    return out.transpose(0, 1)


def deltanet_state(shape: LinearAttentionShape, tp: int, conv_bytes: int) -> StateGeometry:
    """A rank's state per layer: conv channels [q | k | v] (q and k cut by key heads, v by value heads),
    the SSM state [value heads, k_dim, v_dim] fp32 (cut by value heads)."""
    taps = shape.conv_kernel - 1
    key = (shape.num_k_heads, shape.k_head_dim * taps * conv_bytes)
    return StateGeometry(shape.conv_channels // tp, shape.conv_kernel,
                         (shape.num_v_heads // tp, shape.k_head_dim, shape.v_head_dim),
                         (key, key, (shape.num_v_heads, shape.v_head_dim * taps * conv_bytes)),
                         ((shape.num_v_heads, shape.k_head_dim * shape.v_head_dim * 4),))


class GatedRMSNorm(nn.Module):
    """RMSNorm over one head's values, then times silu(z): normalised in fp32, scaled in the model's
    dtype, gated in fp32 (the reference's rounding)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, shape: LinearAttentionShape, hidden: int, eps: float, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        tp = ps.tp_size
        self.ps, self.shape = ps, shape
        self.k_heads, self.v_heads = shape.num_k_heads // tp, shape.num_v_heads // tp
        key_dim, value_dim = shape.num_k_heads * shape.k_head_dim, shape.num_v_heads * shape.v_head_dim
        # the checkpoint's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a as one matmul (one GEMV a decode step
        # instead of four): columns [q | k | v | z | b | a], each section cut by heads
        self.in_proj = MergedColumnParallelLinear(
            hidden, [key_dim, key_dim, value_dim, value_dim, shape.num_v_heads, shape.num_v_heads], ps, dtype)
        channels = shape.conv_channels // tp
        self.conv_weight = nn.Parameter(torch.empty(channels, 1, shape.conv_kernel, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.v_heads, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(shape.v_head_dim, eps, dtype)
        self.out_proj = RowParallelLinear(value_dim, hidden, ps, dtype)

    def load(self, take, prefix: str) -> None:
        """Checkpoint tensors under `prefix` (`model.layers.N.linear_attn.`), each cut to this rank's heads."""
        s, tp, r = self.shape, self.ps.tp_size, self.ps.tp_rank
        key_dim = s.num_k_heads * s.k_head_dim
        sections = [key_dim, key_dim, s.num_v_heads * s.v_head_dim]
        self.in_proj.load(list(take(prefix + "in_proj_qkv.weight").split(sections))
                          + [take(prefix + f"in_proj_{name}.weight") for name in ("z", "b", "a")])
        conv = take(prefix + "conv1d.weight")  # [conv_channels, 1, kernel], channels [q | k | v]
        self.conv_weight.copy_(torch.cat([_shard(part, 0, r, tp) for part in conv.split(sections)]))
        self.A_log.copy_(_shard(take(prefix + "A_log"), 0, r, tp))
        self.dt_bias.copy_(_shard(take(prefix + "dt_bias"), 0, r, tp))
        self.norm.weight.copy_(take(prefix + "norm.weight"))
        self.out_proj.load(take(prefix + "out_proj.weight"))

    def forward(self, x: torch.Tensor, state: RecurrentState, layer: int, seqs: list[StateSlice]) -> torch.Tensor:
        """x: [n, hidden] for every sequence of the step (rows in `seqs` order); each sequence's state
        in slot `seq.slot` of `state` at `layer` (the index among this rank's recurrent layers) is read
        and advanced past its rows. Returns [n, hidden]."""
        s = self.shape
        n = x.shape[0]
        vd = self.v_heads * s.v_head_dim
        qkv, z, b, a = self.in_proj(x).split([self.conv_weight.shape[0], vd, self.v_heads, self.v_heads], dim=-1)
        native = recurrent.deltanet_forward(qkv, z, b, a, state.conv[:, layer], state.ssm[:, layer], seqs,
                                            self.conv_weight, *self._fp32_params(), self.norm.weight,
                                            self.norm.eps, self.k_heads)
        if native is not None:
            return self.out_proj(native)
        z = z.view(n, self.v_heads, s.v_head_dim)
        beta = b.sigmoid().float()  # [n, v_heads]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        batch = decode_slots(seqs, n)
        if batch is not None:  # a decode step: every sequence at once
            slots, fresh = batch
            mixed = causal_conv_step(qkv, state.conv[:, layer], slots, fresh, self.conv_weight, None)
            return self.out_proj(self.norm(self._rule_step(mixed, g, beta, state.ssm[:, layer], slots, fresh), z)
                                 .view(n, -1))
        out = torch.empty(n, self.v_heads, s.v_head_dim, dtype=x.dtype, device=x.device)
        for seq in seqs:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            mixed = self._conv(qkv[rows], state.conv[seq.slot, layer], seq.fresh)
            ssm = state.ssm[seq.slot, layer]
            if seq.fresh:
                ssm.zero_()
            out[rows] = self._rule(mixed, g[rows], beta[rows], ssm)
        return self.out_proj(self.norm(out, z).view(n, -1))

    def _fp32_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-exp(A_log) and dt_bias in fp32 for the native step, recomputed only when a weight changes."""
        key = tuple((p.data_ptr(), p._version) for p in (self.A_log, self.dt_bias))
        if getattr(self, "_fp32_cache", (None,))[0] != key:
            self._fp32_cache = (key, (-self.A_log.float().exp(), self.dt_bias.float().contiguous()))
        return self._fp32_cache[1]

    def _conv(self, qkv: torch.Tensor, conv_state: torch.Tensor, fresh: bool) -> torch.Tensor:
        return causal_conv(qkv, conv_state, self.conv_weight, None, fresh)

    def _qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The conv's output rows [t, channels] as the rule takes them: q, k [t, v_heads, k_dim] (normalised,
        q scaled, each key head repeated for its value heads) and v [t, v_heads, v_dim], fp32."""
        s, t = self.shape, mixed.shape[0]
        kd = self.k_heads * s.k_head_dim
        q, k, v = mixed.split([kd, kd, self.v_heads * s.v_head_dim], dim=-1)
        per = self.v_heads // self.k_heads  # value heads per key head
        q = _l2_normalised(q.float().view(t, self.k_heads, s.k_head_dim)).repeat_interleave(per, dim=1)
        k = _l2_normalised(k.float().view(t, self.k_heads, s.k_head_dim)).repeat_interleave(per, dim=1)
        return q * s.k_head_dim ** -0.5, k, v.float().view(t, self.v_heads, s.v_head_dim)

    def _rule(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
        return delta_rule(*self._qkv(mixed), g, beta, ssm).to(mixed.dtype)

    def _rule_step(self, mixed, g, beta, ssm: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor):
        """One token of each of b sequences (row i: slot slots[i]) through the rule at once; ssm is the
        layer's pool [num_slots, v_heads, k_dim, v_dim]. Returns [b, v_heads, v_dim] in mixed's dtype."""
        q, k, v = self._qkv(mixed)  # [b, v_heads, ...]
        s = ssm[slots]
        s[fresh] = 0
        s = s * g.exp()[:, :, None, None]
        remembered = torch.einsum("bhkv,bhk->bhv", s, k)
        s = s + k.unsqueeze(-1) * ((v - remembered) * beta.unsqueeze(-1)).unsqueeze(-2)
        ssm[slots] = s
        return torch.einsum("bhkv,bhk->bhv", s, q).to(mixed.dtype)
