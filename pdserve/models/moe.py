"""A sparse mixture-of-experts MLP (Qwen3-MoE), in place of the dense MLP of the layers it names:

    probs = softmax(x @ router.T)                  (fp32)
    w, e  = top_k(probs)                           (w / sum(w) with norm_topk_prob; then the model dtype)
    out   = sum_j w_j * expert_{e_j}(x)            (each expert a SwiGLU MLP of moe_intermediate_size)

Tensor parallelism cuts every expert as the dense MLP is cut: gate/up by rows of its intermediate
dimension, down by the same columns, and the router is replicated. Every rank then routes the same way
and computes every routed token on its slice, so the ranks stay balanced whatever the routing (giving
each rank whole experts would leave a rank idle whenever its experts get few tokens, and would need an
all-to-all of the tokens), and the block needs one all-reduce, as the dense MLP does: of the weighted
sum of the experts' partial outputs.

DeepSeek-V3 (`MoeShape.scoring == "sigmoid"`) routes otherwise, in fp32 with an fp32 router as transformers
keeps it: scores = sigmoid(x @ router.T); the experts are ranked by scores + e_score_correction_bias, only
within the `topk_group` groups whose two best biased scores sum highest; the weights are the chosen unbiased
scores (renormalised with norm_topk_prob) times routed_scaling_factor. Its shared experts are one SwiGLU MLP
every token takes, cut over TP like the dense MLP and added to the partial sum before the one all-reduce.

On CPU the choices are grouped by expert (a stable sort of the [tokens * top_k] choices, the rows gathered once),
and the loop runs over the experts that got a token: one gate/up and one down product each, on its span of
the sorted rows. The combine is batched: every output row weighted in one product, put back in token order by
one gather, and summed in top_k adds of [tokens, hidden] whatever the number of experts (an index_add_ per expert
cost 2 ms a call on this 2-core machine, most of a 16-row decode step's MoE). Each token's outputs are added in
the order of their expert ids, as transformers' loop over experts adds them, so a bf16 sum rounds as theirs does.
Nothing loops over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.config import MoeShape
from pdserve.models.layers import MergedColumnParallelLinear, RowParallelLinear
from pdserve.parallel.state import ParallelState


class Expert(nn.Module):
    """One SwiGLU expert's slice of this rank; returns its partial sum (the block all-reduces once)."""

    def __init__(self, hidden: int, intermediate: int, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, ps, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, ps, dtype, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class SparseMoeBlock(nn.Module):
    def __init__(self, shape: MoeShape, hidden: int, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.ps = ps
        self.shape = shape
        self.top_k, self.norm_topk_prob = shape.top_k, shape.norm_topk_prob
        sigmoid = shape.scoring == "sigmoid"
        # router: [num_experts, hidden], whole on every rank; a plain weight (not packed for oneDNN), so the
        # routing logits round as transformers' F.linear rounds them (DeepSeek-V3's in fp32)
        self.router = nn.Parameter(torch.empty(shape.num_experts, hidden, dtype=torch.float32 if sigmoid else dtype),
                                   requires_grad=False)
        self.score_bias = (nn.Parameter(torch.zeros(shape.num_experts), requires_grad=False) if sigmoid else None)
        self.experts = nn.ModuleList(Expert(hidden, shape.intermediate_size, ps, dtype)
                                     for _ in range(shape.num_experts))
        self.shared_experts = (Expert(hidden, shape.shared_intermediate_size, ps, dtype)
                               if shape.shared_intermediate_size else None)

    def load(self, take, prefix: str) -> None:
        """`prefix` is `model.layers.N.mlp.`: its router `gate.weight`, and each expert's three projections."""
        self.router.copy_(take(prefix + "gate.weight"))
        if self.score_bias is not None:
            self.score_bias.copy_(take(prefix + "gate.e_score_correction_bias"))
        experts = [(f"{prefix}experts.{e}.", expert) for e, expert in enumerate(self.experts)]
        if self.shared_experts is not None:
            experts.append((prefix + "shared_experts.", self.shared_experts))
        for p, expert in experts:
            expert.gate_up_proj.load([take(p + "gate_proj.weight"), take(p + "up_proj.weight")])
            expert.down_proj.load(take(p + "down_proj.weight"))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [n, hidden] -> (weights [n, top_k] in x's dtype, expert ids [n, top_k])."""
        if self.score_bias is not None:
            return self._route_grouped(x)
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def _route_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's routing (the module docstring): sigmoid scores, group-limited top-k on biased ones."""
        s, n = self.shape, x.shape[0]
        scores = F.linear(x.float(), self.router).sigmoid()  # [n, experts]
        biased = scores + self.score_bias
        if s.n_group > 1:
            # explicit sizes: a step may route no rows (a prefill chunk that samples nothing)
            groups = biased.view(n, s.n_group, s.num_experts // s.n_group)
            group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1)[0].sum(dim=-1)  # [n, n_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(s.topk_group, dim=-1)[1], True)
            biased = biased.masked_fill(~keep.unsqueeze(-1).expand_as(groups).reshape(n, s.num_experts), float("-inf"))
        chosen = biased.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * s.routed_scaling_factor).to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, hidden] -> [n, hidden]."""
        weights, chosen = self.route(x)
        # a step may route no rows (a prefill chunk that samples nothing)
        out = self._routed(x, weights, chosen) if x.shape[0] else torch.zeros_like(x)
        if self.shared_experts is not None:  # after the routed sum, as transformers adds it
            out += self.shared_experts(x)
        return self.ps.tp_all_reduce(out)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each token's top_k experts (the module docstring): weights, chosen [n, top_k]."""
        n, k = chosen.shape
        choices = chosen.flatten()  # [n * k]: token t's j-th choice at t * k + j
        order = torch.argsort(choices, stable=True)  # choices grouped by expert, tokens ascending within one
        counts = torch.bincount(choices, minlength=len(self.experts)).tolist()
        rows = x[order // k]
        ys, start = [], 0
        for e, count in enumerate(counts):
            if count:
                ys.append(self.experts[e](rows[start:start + count]))
                start += count
        y = torch.cat(ys) if len(ys) > 1 else ys[0]
        y.mul_(weights.flatten()[order].unsqueeze(1))  # [n * k, hidden] in expert order
        sorted_at = torch.empty_like(order)
        sorted_at[order] = torch.arange(n * k, device=x.device)  # choice -> its row of y
        by_expert = chosen.argsort(dim=1, stable=True) + torch.arange(0, n * k, k, device=x.device).unsqueeze(1)
        y = y[sorted_at[by_expert.flatten()]].view(n, k, -1)  # each token's outputs, its experts ascending
        if k == 1:
            return y[:, 0]
        out = y[:, 0] + y[:, 1]
        for j in range(2, k):
            out += y[:, j]
        return out
