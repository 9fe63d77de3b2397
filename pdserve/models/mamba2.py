"""Mamba2: the selective state-space mixer of Nemotron-H's recurrent layers.

Each of `num_heads` heads keeps a state S: [head_dim, state_size] (fp32) that every token t updates:

    dt = softplus(dt_raw + dt_bias), clamped below at time_step_min
    S <- exp(dt * A) * S + dt * x B^T           A = -exp(A_log) < 0, one per head
    y  = S C + D * x                             x: the head's channels; B, C: its group's vectors

x, B and C come out of a depthwise causal conv over [x | B | C] channels (the conv state: the last
taps - 1 inputs); y passes a gated, grouped RMSNorm (y * silu(z), normalised per group of heads) and the
output projection. Both states live in `RecurrentState` (recurrent_state.py), one slot per sequence.

Tensor parallelism cuts by heads and groups: the input projection [z | x | B | C | dt] and the conv's
[x | B | C] section by section, so each rank keeps whole groups and the heads that read them (head h reads
group h // (num_heads // n_groups)). transformers clamps dt only in its chunked prefill; here every step
clamps, which differs only where softplus(dt_raw + dt_bias) < time_step_min.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.shapes import Mamba2Shape
from pdserve.kernels import recurrent
from pdserve.models.layers import MergedColumnParallelLinear, RowParallelLinear, _shard
from pdserve.models.recurrent_state import (RecurrentState, StateGeometry, StateSlice, causal_conv, causal_conv_step,
                                           decode_slots)
from pdserve.parallel.state import ParallelState

CHUNK = 64  # tokens the chunked scan takes at once


def mamba2_state(shape: Mamba2Shape, tp: int, conv_bytes: int) -> StateGeometry:
    """A rank's state per layer: conv channels [x | B | C] (x cut by heads, B and C by groups), the SSM
    state [heads, head_dim, state_size] fp32 (cut by heads)."""
    taps = shape.conv_kernel - 1
    group = (shape.n_groups, shape.state_size * taps * conv_bytes)
    return StateGeometry(shape.conv_channels // tp, shape.conv_kernel,
                         (shape.num_heads // tp, shape.head_dim, shape.state_size),
                         ((shape.num_heads, shape.head_dim * taps * conv_bytes), group, group),
                         ((shape.num_heads, shape.head_dim * shape.state_size * 4),))


def ssd(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
        state: torch.Tensor) -> torch.Tensor:
    """The scan over one sequence's tokens, updating `state` in place; token by token for a decode step,
    else in chunks of CHUNK tokens (`ssd_chunk`, the same sums).

    x: [n, heads, head_dim]; dt: [n, heads]; a: [heads] (< 0); b, c: [n, heads, state_size] (each head's
    group's vectors); all fp32; state: [heads, head_dim, state_size] fp32. Returns S C: [n, heads, head_dim]."""
    if x.shape[0] == 1:
        state.mul_((dt[0] * a).exp()[:, None, None]).add_((dt[0, :, None] * x[0])[:, :, None] * b[0][:, None, :])
        return torch.einsum("hpn,hn->hp", state, c[0]).unsqueeze(0)
    return torch.cat([ssd_chunk(x[i:i + CHUNK], dt[i:i + CHUNK], a, b[i:i + CHUNK], c[i:i + CHUNK], state)
                      for i in range(0, x.shape[0], CHUNK)])


def ssd_chunk(x, dt, a, b, c, state):
    """`ssd` over a chunk at once. With G_t = sum of dt_i * a up to t and v_i = dt_i x_i, the state after
    token t is S_t = e^{G_t} S_0 + sum_{i<=t} e^{G_t - G_i} v_i b_i^T, so

        Y = diag(e^G) C S_0^T + (M * C B^T) V,   M_ti = e^{G_t - G_i} for i <= t, else 0
        S_c = e^{G_c} S_0 + V^T diag(e^{G_c - G}) B

    per head; every exponent is <= 0, so nothing overflows."""
    n = x.shape[0]
    G = (dt * a).t().cumsum(-1)  # [heads, n]
    v = (dt.unsqueeze(-1) * x).transpose(0, 1)  # [heads, n, head_dim]
    bh, ch = b.transpose(0, 1), c.transpose(0, 1)  # [heads, n, state]
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    decay = torch.where(causal, G.unsqueeze(-1) - G.unsqueeze(-2), float("-inf")).exp()  # M: [heads, n, n]
    y = G.exp().unsqueeze(-1) * (ch @ state.transpose(1, 2)) + (decay * (ch @ bh.transpose(1, 2))) @ v
    last = G[:, -1:]
    state.mul_(last.exp().unsqueeze(-1)).add_((v * (last - G).exp().unsqueeze(-1)).transpose(1, 2) @ bh)
    return y.transpose(0, 1)


class Mamba2Mixer(nn.Module):
    def __init__(self, shape: Mamba2Shape, hidden: int, eps: float, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        tp = ps.tp_size
        self.ps, self.shape, self.eps = ps, shape, eps
        self.heads, self.groups = shape.num_heads // tp, shape.n_groups // tp
        inner, bc = shape.intermediate_size, shape.n_groups * shape.state_size
        self.in_proj = MergedColumnParallelLinear(hidden, [inner, inner, bc, bc, shape.num_heads], ps, dtype)
        channels = shape.conv_channels // tp
        self.conv_weight = nn.Parameter(torch.empty(channels, 1, shape.conv_kernel, dtype=dtype), requires_grad=False)
        self.conv_bias = (nn.Parameter(torch.empty(channels, dtype=dtype), requires_grad=False)
                          if shape.conv_bias else None)
        self.A_log = nn.Parameter(torch.empty(self.heads, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.heads, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.heads, dtype=dtype), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(inner // tp, dtype=dtype), requires_grad=False)
        self.out_proj = RowParallelLinear(inner, hidden, ps, dtype)

    def load(self, take, prefix: str) -> None:
        """Checkpoint tensors under `prefix` (`model.layers.N.mixer.`), each cut to this rank's heads and groups."""
        s, tp, r = self.shape, self.ps.tp_size, self.ps.tp_rank
        inner, bc = s.intermediate_size, s.n_groups * s.state_size
        self.in_proj.load(list(take(prefix + "in_proj.weight").split([inner, inner, bc, bc, s.num_heads])))
        sections = [inner, bc, bc]  # the conv's channels [x | B | C]
        conv = take(prefix + "conv1d.weight")
        self.conv_weight.copy_(torch.cat([_shard(p, 0, r, tp) for p in conv.split(sections)]))
        if self.conv_bias is not None:
            self.conv_bias.copy_(torch.cat([_shard(p, 0, r, tp) for p in take(prefix + "conv1d.bias").split(sections)]))
        for name in ("A_log", "D", "dt_bias"):
            getattr(self, name).copy_(_shard(take(prefix + name), 0, r, tp))
        self.norm_weight.copy_(_shard(take(prefix + "norm.weight"), 0, r, tp))
        self.out_proj.load(take(prefix + "out_proj.weight"))

    def forward(self, x: torch.Tensor, state: RecurrentState, layer: int, seqs: list[StateSlice]) -> torch.Tensor:
        """x: [n, hidden] for every sequence of the step (rows in `seqs` order); each sequence's state in slot
        `seq.slot` at `layer` (its index among this rank's recurrent layers) is read and advanced past its
        rows. Returns [n, hidden]."""
        s, n = self.shape, x.shape[0]
        inner, bc = self.heads * s.head_dim, self.groups * s.state_size
        z, xbc, dt = self.in_proj(x).split([inner, inner + 2 * bc, self.heads], dim=-1)
        native = recurrent.mamba2_forward(z, xbc, dt, state.conv[:, layer], state.ssm[:, layer], seqs,
                                          self.conv_weight, self.conv_bias, *self._fp32_params(),
                                          s.time_step_min, self.norm_weight, self.eps, self.groups)
        if native is not None:
            return self.out_proj(native)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=s.time_step_min)  # [n, heads]
        a = -self.A_log.float().exp()
        per = self.heads // self.groups
        batch = decode_slots(seqs, n)
        if batch is not None:  # a decode step: every sequence at once
            slots, fresh = batch
            mixed = causal_conv_step(xbc, state.conv[:, layer], slots, fresh, self.conv_weight, self.conv_bias)
            xs, b, c = mixed.float().split([inner, bc, bc], dim=-1)
            xs = xs.view(n, self.heads, s.head_dim)
            b = b.view(n, self.groups, s.state_size).repeat_interleave(per, dim=1)
            c = c.view(n, self.groups, s.state_size).repeat_interleave(per, dim=1)
            ssm = state.ssm[:, layer]
            h = ssm[slots]  # [n, heads, head_dim, state]
            h[fresh] = 0
            h = h * (dt * a).exp()[:, :, None, None] + (dt.unsqueeze(-1) * xs).unsqueeze(-1) * b.unsqueeze(-2)
            ssm[slots] = h
            y = torch.einsum("bhpn,bhn->bhp", h, c) + self.D.float()[:, None] * xs
            return self.out_proj(self._gated_norm(y.view(n, inner), z).to(x.dtype))
        y = torch.empty(n, self.heads, s.head_dim, dtype=torch.float32, device=x.device)
        for seq in seqs:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            mixed = causal_conv(xbc[rows], state.conv[seq.slot, layer], self.conv_weight, self.conv_bias, seq.fresh)
            xs, b, c = mixed.float().split([inner, bc, bc], dim=-1)
            ssm = state.ssm[seq.slot, layer]
            if seq.fresh:
                ssm.zero_()
            t = seq.q_len
            xs = xs.view(t, self.heads, s.head_dim)
            b = b.view(t, self.groups, s.state_size).repeat_interleave(per, dim=1)
            c = c.view(t, self.groups, s.state_size).repeat_interleave(per, dim=1)
            y[rows] = ssd(xs, dt[rows], a, b, c, ssm) + self.D.float()[:, None] * xs
        return self.out_proj(self._gated_norm(y.view(n, inner), z).to(x.dtype))

    def _fp32_params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-exp(A_log), dt_bias and D in fp32 for the native step, recomputed only when a weight changes."""
        key = tuple((p.data_ptr(), p._version) for p in (self.A_log, self.dt_bias, self.D))
        if getattr(self, "_fp32_cache", (None,))[0] != key:
            self._fp32_cache = (key, (-self.A_log.float().exp(), self.dt_bias.float().contiguous(),
                                      self.D.float().contiguous()))
        return self._fp32_cache[1]

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y * silu(z), RMS-normalised per group (in fp32), times the weight."""
        g = (y * F.silu(z.float())).view(y.shape[0], self.groups, -1)
        g = g * torch.rsqrt(g.square().mean(-1, keepdim=True) + self.eps)
        return self.norm_weight * g.view(y.shape)
