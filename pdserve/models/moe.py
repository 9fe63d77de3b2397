"""A sparse mixture-of-experts MLP (Qwen3-MoE), in place of the dense MLP of the layers it names:

    probs = softmax(x @ router.T)                  (fp32)
    w, e  = top_k(probs)                           (w / sum(w) with norm_topk_prob; then the model dtype)
    out   = sum_j w_j * expert_{e_j}(x)            (each expert a SwiGLU MLP of moe_intermediate_size)

Tensor parallelism places the routed experts one of two ways (EngineConfig.moe_experts); the router is
replicated, so every rank routes the same way, and either way the block needs one all-reduce, as the dense
MLP does:

- sharded (the default): every expert cut as the dense MLP is cut, gate/up by rows of its intermediate
  dimension, down by the same columns. Every rank computes every routed token on its slice, and the
  all-reduce sums the experts' partial outputs. Balanced whatever the routing.
- replicated: every rank holds every expert whole (their memory tp_size times). The step's [tokens * top_k]
  choices, sorted by expert, are cut into tp_size contiguous spans of equal length, and each rank computes
  its span on whole experts: as many rows each, whatever the routing, and each expert's weights read by one
  rank, or two where a span boundary falls inside it. The other ranks' rows are zeros in a rank's sum, so
  the all-reduce adds each token's outputs from the ranks that computed them.
  Giving each rank whole experts of its own instead (expert parallelism) would leave a rank idle whenever
  its experts get few tokens; replicating them keeps the ranks balanced at the cost of memory.

DeepSeek-V3 (`MoeShape.scoring == "sigmoid"`) routes otherwise, in fp32 with an fp32 router as transformers
keeps it: scores = sigmoid(x @ router.T); the experts are ranked by scores + e_score_correction_bias, only
within the `topk_group` groups whose two best biased scores sum highest; the weights are the chosen unbiased
scores (renormalised with norm_topk_prob) times routed_scaling_factor. Its shared experts are one SwiGLU MLP
every token takes, cut over TP like the dense MLP (either way) and added to the partial sum before the one
all-reduce.

Qwen3.5-MoE (`MoeShape.shared_gate`) routes as Qwen3-MoE and adds one shared expert (`shared_expert.*`, in the
singular) scaled per token by sigmoid(x @ shared_expert_gate.T), a [1, hidden] weight whole on every rank: the
scale is the same on every rank, so it multiplies the rank's partial sum before the all-reduce.

Nemotron-H's MoE layers (`MoeShape.activation == "relu2"`, Nemotron 3) route as DeepSeek-V3 does; their
experts, the one shared expert too, are down(relu(up(x))^2), not gated, each cut over TP as the dense MLP.
With `latent_size` (Nemotron 3 Super) the routed experts work in a latent: x is projected down to it first
(whole on every rank, the routing still reads x), and their weighted sum projected back up; that up projection
is linear, so it maps each rank's partial sum before the one all-reduce. Its routing weights stay fp32, so each
expert's output is weighted and the top_k summed in fp32 and cast once, as transformers' Nemotron-H experts do.

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

from pdserve.models.shapes import MoeShape
from pdserve.models.layers import ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
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


class Relu2Expert(nn.Module):
    """One squared-ReLU expert's slice (Nemotron-H), not gated; returns its partial sum as Expert does."""

    def __init__(self, hidden: int, intermediate: int, ps: ParallelState, dtype: torch.dtype):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden, intermediate, False, ps, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, ps, dtype, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square_())


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
        whole = ParallelState() if shape.replicated else ps  # a replicated expert's linears keep every row
        kind = Relu2Expert if shape.activation == "relu2" else Expert
        width = shape.latent_size or hidden  # the routed experts' input and output
        self.experts = nn.ModuleList(kind(width, shape.intermediate_size, whole, dtype)
                                     for _ in range(shape.num_experts))
        self.shared_experts = (kind(hidden, shape.shared_intermediate_size, ps, dtype)
                               if shape.shared_intermediate_size else None)
        self.shared_gate = (nn.Parameter(torch.empty(1, hidden, dtype=dtype), requires_grad=False)
                            if shape.shared_gate else None)
        self.latent_in = ReplicatedLinear(hidden, width, False, ps, dtype) if shape.latent_size else None
        self.latent_out = ReplicatedLinear(width, hidden, False, ps, dtype) if shape.latent_size else None

    def load(self, take, prefix: str) -> None:
        """`prefix` is `model.layers.N.mlp.` (Nemotron-H: `.mixer.`): its router `gate.weight`, and each expert's
        projections (three; Nemotron-H's two), the latent ones `fc1_latent_proj` and `fc2_latent_proj`."""
        self.router.copy_(take(prefix + "gate.weight"))
        if self.score_bias is not None:
            self.score_bias.copy_(take(prefix + "gate.e_score_correction_bias"))
        experts = [(f"{prefix}experts.{e}.", expert) for e, expert in enumerate(self.experts)]
        if self.shared_gate is not None:
            self.shared_gate.copy_(take(prefix + "shared_expert_gate.weight"))
        if self.shared_experts is not None:
            experts.append((prefix + ("shared_expert." if self.shared_gate is not None else "shared_experts."),
                            self.shared_experts))
        for p, expert in experts:
            if isinstance(expert, Relu2Expert):
                expert.up_proj.load(take(p + "up_proj.weight"))
            else:
                expert.gate_up_proj.load([take(p + "gate_proj.weight"), take(p + "up_proj.weight")])
            expert.down_proj.load(take(p + "down_proj.weight"))
        if self.latent_in is not None:
            self.latent_in.load(take(prefix + "fc1_latent_proj.weight"))
            self.latent_out.load(take(prefix + "fc2_latent_proj.weight"))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [n, hidden] -> (weights [n, top_k] in x's dtype, Nemotron-H's in fp32; expert ids [n, top_k])."""
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
        weights = weights * s.routed_scaling_factor
        return (weights if s.activation == "relu2" else weights.to(x.dtype)), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, hidden] -> [n, hidden]."""
        weights, chosen = self.route(x)
        routed_in = x if self.latent_in is None else self.latent_in(x)
        # a step may route no rows (a prefill chunk that samples nothing)
        out = self._routed(routed_in, weights, chosen).to(x.dtype) if x.shape[0] else torch.zeros_like(routed_in)
        if self.latent_out is not None:
            out = self.latent_out(out)
        if self.shared_experts is not None:  # after the routed sum, as transformers adds it
            shared = self.shared_experts(x)
            out += shared if self.shared_gate is None else torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return self.ps.tp_all_reduce(out)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each token's top_k experts (the module docstring): weights, chosen [n, top_k].
        Replicated experts: of the choices in this rank's span only, the others' rows zero."""
        n, k = chosen.shape
        choices = chosen.flatten()  # [n * k]: token t's j-th choice at t * k + j
        order = torch.argsort(choices, stable=True)  # choices grouped by expert, tokens ascending within one
        lo, hi = self._span(n * k)
        mine = order[lo:hi]
        y = self._experts_on(x[mine // k], choices[mine], x.shape[1])
        w = weights.flatten()[mine].unsqueeze(1)
        y = y.mul_(w) if w.dtype == y.dtype else y * w  # [hi - lo, hidden] in expert order (fp32 weights: fp32)
        if hi - lo < n * k:
            y = torch.cat([y.new_zeros(lo, y.shape[1]), y, y.new_zeros(n * k - hi, y.shape[1])])
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

    def _span(self, choices: int) -> tuple[int, int]:
        """The expert-sorted choices this rank computes: all of them, or its 1/tp_size when replicated."""
        if not self.shape.replicated:
            return 0, choices
        tp, r = self.ps.tp_size, self.ps.tp_rank
        return choices * r // tp, choices * (r + 1) // tp

    def _experts_on(self, rows: torch.Tensor, experts: torch.Tensor, hidden: int) -> torch.Tensor:
        """rows [m, hidden] grouped by their experts [m] (ascending) -> each row through its expert."""
        counts = torch.bincount(experts, minlength=len(self.experts)).tolist()
        ys, start = [], 0
        for e, count in enumerate(counts):
            if count:
                ys.append(self.experts[e](rows[start:start + count]))
                start += count
        if len(ys) == 1:
            return ys[0]
        return torch.cat(ys) if ys else rows.new_empty(0, hidden)
