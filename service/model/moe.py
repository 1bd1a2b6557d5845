"""DeepSeek's mixture of experts: the router (V2 softmax, V3 sigmoid with a correction bias,
grouped top-k) and the routed experts, graph-safe.

The routed experts run as two grouped GEMMs (service.model.grouped_gemm) over the token-expert pairs
sorted by expert: every shape is fixed by the token count (T*k pairs), the per-expert group
offsets are computed on the device, and nothing reads a count back to the host, so the whole
layer captures into a CUDA graph (and traces on CPU) for any routing. A loop over experts, as
the reference implementations write it, needs each expert's token count on the host (a sync
per expert, and shapes a graph cannot hold); a dense all-experts product is graph-safe but
costs E/k times the FLOPs. The combine is deterministic: each pair's output returns to its
(token, choice) row and the k choices are summed, with no atomics.

Tensor parallel: each expert's intermediate dim is split across ranks like a dense MLP's; the
routed and shared experts' partial outputs are summed and all-reduced once.

Shapes: T tokens, H hidden, E experts, k experts per token, I intermediate per expert (this
rank's part).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from service.errors import CheckpointError
from service.model.arch_config import ArchConfig, MoeConfig
from service.model.grouped_gemm import grouped_mm
from service.model.kernels import Kernels
from service.model.llama import MLP
from service.model.parallel import TPGroup, shape_of, take


def keep_fp32(param: nn.Parameter) -> nn.Parameter:
    """Mark a parameter that stays float32 whatever the model dtype (routing decisions)."""
    param.keep_fp32 = True  # type: ignore[attr-defined]
    return param


class Router(nn.Module):
    def __init__(self, cfg: MoeConfig, hidden: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = keep_fp32(nn.Parameter(torch.empty(cfg.num_experts, hidden), False))
        self.e_score_correction_bias = (
            keep_fp32(nn.Parameter(torch.zeros(cfg.num_experts), False))
            if cfg.topk_method == "noaux_tc"
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> routing weights (T, k) float32 and expert ids (T, k) int64."""
        c = self.cfg
        logits = F.linear(x.float(), self.weight.float())  # (T, E)
        scores = logits.softmax(-1) if c.scoring == "softmax" else logits.sigmoid()
        choice = scores
        if self.e_score_correction_bias is not None:  # V3: the bias steers choice, not weight
            choice = scores + self.e_score_correction_bias
        if c.topk_method != "greedy":  # keep the experts of the best topk_groups groups
            grouped = choice.view(-1, c.num_groups, c.num_experts // c.num_groups)
            if c.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.max(-1).values
            best = group_scores.topk(c.topk_groups, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores).scatter_(1, best, 1.0).bool()  # (T, G)
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)
            fill = float("-inf") if c.topk_method == "noaux_tc" else 0.0
            choice = choice.masked_fill(~keep, fill)
        ids = choice.topk(c.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if c.norm_topk_prob and c.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids


class RoutedExperts(nn.Module):
    def __init__(self, cfg: MoeConfig, hidden: int, tp: TPGroup, kernels: Kernels) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.inter = tp.split(cfg.moe_intermediate_size, "moe_intermediate_size")
        e, i = cfg.num_experts, self.inter
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden), False)  # gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(e, hidden, i), False)
        self.w13.weight_loader = self._load_w13  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load_w2  # type: ignore[attr-defined]
        self.kernels = kernels

    def _load_w13(self, param: nn.Parameter, loaded: object, shard: object) -> None:
        expert, part = shard  # type: ignore[misc]
        i = self.inter
        expected = (i * self.tp.world_size, param.shape[2])
        if shape_of(loaded) != expected:
            raise CheckpointError(f"expected shape {expected}, found {shape_of(loaded)}")
        rows = take(loaded, 0, self.tp.rank * i, i)
        param.data[expert, part * i : (part + 1) * i].copy_(rows.to(param.dtype))

    def _load_w2(self, param: nn.Parameter, loaded: object, shard: object) -> None:
        i = self.inter
        expected = (param.shape[1], i * self.tp.world_size)
        if shape_of(loaded) != expected:
            raise CheckpointError(f"expected shape {expected}, found {shape_of(loaded)}")
        param.data[shard].copy_(take(loaded, 1, self.tp.rank * i, i).to(param.dtype))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (T, H), weights and ids (T, k) -> this rank's partial sum (T, H)."""
        t, k = ids.shape
        flat = ids.reshape(-1)  # (T*k,) pair p = token p // k, choice p % k
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        rows = x.index_select(0, order // k)  # (T*k, H)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)  # end of each expert's group
        gate_up = grouped_mm(rows, self.w13.transpose(1, 2), offsets)  # (T*k, 2I)
        out = grouped_mm(self.kernels.silu_and_mul(gate_up), self.w2.transpose(1, 2), offsets)
        out = out * weights.reshape(-1).index_select(0, order).unsqueeze(1).to(out.dtype)
        pairs = torch.empty_like(out).index_copy_(0, order, out)  # back to (token, choice) order
        return pairs.view(t, k, -1).sum(1)


class MoE(nn.Module):
    """Routed experts plus shared experts; one all-reduce for both."""

    def __init__(self, cfg: ArchConfig, tp: TPGroup, kernels: Kernels) -> None:
        super().__init__()
        moe = cfg.moe
        if moe is None:
            raise ValueError("MoE layer without a MoE config")
        self.tp = tp
        self.gate = Router(moe, cfg.hidden_size)
        self.experts = RoutedExperts(moe, cfg.hidden_size, tp, kernels)
        self.kernels = kernels
        self.shared_experts = None
        if moe.num_shared_experts:  # a dense MLP; its partial sum joins the routed experts'
            self.shared_experts = MLP(
                cfg, tp, kernels, moe.moe_intermediate_size * moe.num_shared_experts
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts.partial(x)
        return self.tp.all_reduce(out)
