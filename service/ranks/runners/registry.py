"""Backend name -> graph runner. One place, so errors list what is supported."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.buckets import GRAPH_BACKENDS, BucketPlan, PlanError
from service.ranks.runners.base import PrefillRunner

if TYPE_CHECKING:
    from service.ranks.worker import RankWorker


def make_runner(plan: BucketPlan, worker: RankWorker) -> PrefillRunner:
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
    return runners[plan.backend](
        plan, worker.model, worker.eager_attention, worker.graph_attention, worker.device
    )
