"""Backend name -> graph runner. One place, so errors list what is supported."""

from __future__ import annotations

import torch

from service.buckets import GRAPH_BACKENDS, BucketPlan
from service.errors import PlanError
from service.model.llama import CausalLM
from service.ranks.attention.base import AttentionBackend
from service.ranks.runners.base import PrefillRunner


def make_runner(
    plan: BucketPlan,
    model: CausalLM,
    eager_attention: AttentionBackend,
    graph_attention: AttentionBackend,
    device: torch.device,
) -> PrefillRunner:
    from service.ranks.runners.breakable import BreakableGraphRunner
    from service.ranks.runners.full import FullGraphRunner
    from service.ranks.runners.tc_piecewise import TcPiecewiseGraphRunner

    runners = {
        "full": FullGraphRunner,
        "breakable": BreakableGraphRunner,
        "tc_piecewise": TcPiecewiseGraphRunner,
    }
    if plan.backend not in runners:
        raise PlanError(
            f"unsupported prefill graph backend {plan.backend!r}; supported: {list(GRAPH_BACKENDS)}"
        )
    return runners[plan.backend](plan, model, eager_attention, graph_attention, device)
