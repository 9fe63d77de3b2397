"""The recurrent layers' state of a hybrid model (Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba2), one slot
per running sequence, and the pieces both mixers share: the step's per-sequence rows and the causal conv.

A recurrent mixer keeps two things per sequence and layer: the last (taps - 1) inputs of its depthwise
causal conv, and the SSM state its recurrence carries. A sequence's output after a chunk depends only on
its slot and the chunk, so a prompt prefilled in chunks of any size, batched with any others, leaves the
state the whole prompt leaves.

Each family describes its state's byte sections (`StateGeometry.conv_sections`, `ssm_sections`: per
section, the units tensor parallelism cuts it by and the bytes of one unit), which the KV exchange uses to
re-cut a state between TP layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class StateSlice:
    """One sequence's rows in a step, for the recurrent layers."""

    q_start: int  # first row of the sequence in the step's flattened tokens
    q_len: int
    fresh: bool  # no tokens before this chunk: the state starts at zero
    slot: int  # its slot in RecurrentState


@dataclass(frozen=True)
class StateGeometry:
    """One rank's per-layer state: conv [channels, taps - 1] in the model's dtype, SSM `ssm_shape` fp32; the
    sections of each, as (units in the whole model, bytes of one unit on a rank of this dtype)."""

    conv_channels: int  # this rank's
    taps: int
    ssm_shape: tuple[int, ...]  # this rank's
    conv_sections: tuple[tuple[int, int], ...]
    ssm_sections: tuple[tuple[int, int], ...]


class RecurrentState:
    """The state pools of one rank's recurrent layers:

    conv: [num_slots, layers, channels, taps - 1] in the model's dtype
    ssm:  [num_slots, layers, *ssm_shape] fp32
    """

    def __init__(self, geometry: StateGeometry, num_layers: int, num_slots: int, dtype: torch.dtype,
                 device: torch.device, allocator=None):
        def pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if allocator is None:  # else memory the KV exchange's agent can expose (shared_pool_allocator)
                return torch.zeros(shape, dtype=dtype, device=device)
            return allocator(math.prod(shape) * dtype.itemsize).view(dtype).view(shape).zero_()

        self.geometry = geometry
        self.conv = pool((num_slots, num_layers, geometry.conv_channels, geometry.taps - 1), dtype)
        self.ssm = pool((num_slots, num_layers, *geometry.ssm_shape), torch.float32)

    @property
    def num_slots(self) -> int:
        return self.conv.shape[0]


def decode_slots(seqs: list[StateSlice], rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A step in which every sequence computes one token, row i being seqs[i]: its slots [b] and which of them
    start fresh [b] (a one-token prompt), for the batched step (`causal_conv_step` and the mixers'); None for
    any other step, which goes sequence by sequence."""
    if len(seqs) != rows or any(s.q_len != 1 for s in seqs):
        return None
    return torch.tensor([s.slot for s in seqs]), torch.tensor([s.fresh for s in seqs])


def causal_conv_step(x: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`causal_conv` of one token for each of b sequences at once: x [b, channels]; conv the layer's pool
    [num_slots, channels, taps - 1], read and written at `slots`, zeros for the `fresh` ones."""
    states = conv[slots]  # [b, channels, taps - 1] (a copy)
    states[fresh] = 0
    window = torch.cat([states, x.unsqueeze(-1).to(weight.dtype)], dim=-1)  # [b, channels, taps]
    conv[slots] = window[:, :, 1:]
    out = F.conv1d(window, weight, bias, groups=window.shape[1])[:, :, 0]  # [b, channels]
    return F.silu(out).to(x.dtype)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                fresh: bool) -> torch.Tensor:
    """Depthwise causal conv + silu of one sequence's rows x: [t, channels], after the inputs kept in
    conv_state [channels, taps - 1] (zeros for a fresh sequence), which then keeps the last ones.
    weight: [channels, 1, taps]. Computed in the weight's dtype, returned in x's."""
    t = x.shape[0]
    if fresh:
        conv_state.zero_()
    window = torch.cat([conv_state, x.t().to(weight.dtype)], dim=1)  # [channels, taps - 1 + t]
    conv_state.copy_(window[:, t:])
    out = F.conv1d(window.unsqueeze(0), weight, bias, groups=window.shape[0])[0]  # [channels, t]
    return F.silu(out).t().to(x.dtype)
