"""Start-up agreement across ranks: one legal bucket set, captured in lockstep, largest first.

1. Every rank resolves its own legal set (from its own request pool and memory).
2. The coordinator agrees on the intersection (service.buckets.agree_plans).
3. Every rank builds its runner for exactly that set and captures bucket by bucket, in the same
   order; each capture call returns on every rank before the next starts (the executor's
   barrier). A bucket that fails on any rank is dropped on all of them.
4. If nothing survives, one warning names backend, context length and request capacity, and
   prefill runs eagerly; start-up does not fail for it.
"""

from __future__ import annotations

import logging
import time

from service.buckets import GRAPH_BACKENDS, BucketPlan, agree_plans, drop_buckets
from service.capture_result import CaptureFailure, CaptureStat
from service.config import EngineConfig
from service.errors import RankFailure
from service.executors.base import Executor
from service.rank_info import agree_rank_infos
from service.resolved import RankCapture, ResolvedConfig

log = logging.getLogger("service.coordinator")


def capture_agreed(executor: Executor, agreed: BucketPlan) -> tuple[BucketPlan, list[RankCapture]]:
    """Capture every agreed bucket on every rank, largest first (one shared graph pool); a
    bucket that fails anywhere is dropped everywhere. Returns the plan that replays."""
    executor.build_runners(agreed)
    failures: dict[int, str] = {}
    stats: dict[int, list[CaptureStat]] = {}
    order = sorted(agreed.bucket_sizes, reverse=True)
    t_all = time.perf_counter()
    for n, size in enumerate(order, 1):
        results = executor.capture_bucket(agreed, size)
        errors = [r for r in results if isinstance(r, CaptureFailure)]
        if any(e.desync for e in errors):
            # a rank failed before a collective its peers waited in: their process groups are
            # out of step, so no later graph or forward can be trusted; the root cause first
            causes = sorted(errors, key=lambda e: e.desync)
            raise RankFailure(
                f"capture of bucket {size} left the ranks' collectives out of step: "
                + "; ".join(str(e) for e in causes)
            )
        if errors:
            failures[size] = "; ".join(str(e) for e in errors)
            log.warning("Capture prefill graph: bucket %d failed: %s", size, failures[size])
            continue
        ok = [r for r in results if isinstance(r, CaptureStat)]
        for rank, stat in enumerate(ok):
            stats.setdefault(rank, []).append(stat)
        lens = agreed.bucket(size).capture_seq_lens
        log.info(
            "Capture prefill graph [%d/%d]: bucket %d as %d synthetic requests %s, "
            "%.3f s, %.1f MiB",
            n,
            len(order),
            size,
            sum(1 for x in lens if x),
            list(lens),
            max(s.seconds for s in ok),
            max(s.memory_bytes for s in ok) / 2**20,
        )
    plan = drop_buckets(agreed, failures)
    log.info(
        "Capture prefill graphs done: %d buckets in %.2f s (%s), %d dropped",
        len(plan.buckets),
        time.perf_counter() - t_all,
        executor.graph_kind(),
        len(failures),
    )
    return plan, [RankCapture(rank, tuple(s)) for rank, s in sorted(stats.items())]


def start_up(cfg: EngineConfig, executor: Executor) -> ResolvedConfig:
    infos = executor.infos()
    limits = agree_rank_infos(infos)
    agreed = agree_plans(executor.local_plans())
    plan, captures = capture_agreed(executor, agreed) if agreed.enabled else (agreed, [])
    if not plan.enabled and plan.backend in GRAPH_BACKENDS:
        log.warning("Disable prefill graphs: %s", plan.disabled_reason)
        executor.build_runners(plan)  # back to eager everywhere; no runner for an empty list
    return ResolvedConfig(
        config=cfg,
        executor=executor.kind,
        tp=len(infos),
        limits=limits,
        plan=plan,
        graph_kind=executor.graph_kind() if plan.enabled else None,
        captures=tuple(captures),
    )
