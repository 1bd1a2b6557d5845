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

from service.buckets import GRAPH_BACKENDS, PlanError, agree_plans, drop_buckets
from service.config import EngineConfig
from service.executor import Executor
from service.resolved import RankCapture, ResolvedConfig

log = logging.getLogger("service.coordinator")


def start_up(cfg: EngineConfig, executor: Executor) -> ResolvedConfig:
    infos = executor.infos()
    kernels = {i.attention.name for i in infos}
    if len(kernels) > 1:  # ranks of one model must run the same attention kernels
        raise PlanError(
            "ranks chose different attention backends: "
            + ", ".join(f"rank {i.rank}: {i.attention.name} ({i.attention.reason})" for i in infos)
            + "; pass --attention-backend explicitly"
        )
    agreed = agree_plans(executor.local_plans())
    captures: dict[int, list[dict]] = {i: [] for i in range(len(infos))}
    if agreed.enabled:
        executor.build_runners(agreed)
        failures: dict[int, str] = {}
        order = sorted(agreed.bucket_sizes, reverse=True)  # largest first: one shared pool
        t_all = time.perf_counter()
        for n, size in enumerate(order, 1):
            results = executor.capture_bucket(agreed, size)
            errors = [r for r in results if isinstance(r, str)]
            if errors:
                failures[size] = "; ".join(errors)
                log.warning("Capture prefill graph: bucket %d failed: %s", size, failures[size])
                continue
            for rank, stat in enumerate(results):
                captures[rank].append(stat.to_json())
            worst = max(results, key=lambda s: s.seconds)
            lens = agreed.bucket(size).capture_seq_lens
            log.info(
                "Capture prefill graph [%d/%d]: bucket %d as %d synthetic requests %s, "
                "%.3f s, %.1f MiB",
                n,
                len(order),
                size,
                sum(1 for x in lens if x),
                list(lens),
                worst.seconds,
                max(s.memory_bytes for s in results) / 2**20,
            )
        plan = drop_buckets(agreed, failures)
        log.info(
            "Capture prefill graphs done: %d buckets in %.2f s (%s), %d dropped",
            len(plan.buckets),
            time.perf_counter() - t_all,
            executor.graph_kind(),
            len(failures),
        )
    else:
        plan = agreed
    if not plan.enabled and plan.backend in GRAPH_BACKENDS:
        log.warning("Disable prefill graphs: %s", plan.disabled_reason)
        executor.build_runners(plan)  # back to eager everywhere; no runner for an empty list
    first = infos[0]
    return ResolvedConfig(
        config=cfg,
        model_dir=first.model_dir,
        architecture=first.architecture,
        device=first.device,
        dtype=first.dtype,
        tp=len(infos),
        executor=executor.kind,
        context_length=first.context_length,
        max_running_requests=min(i.max_running_requests for i in infos),
        num_kv_slots=min(i.num_kv_slots for i in infos),
        chunked_prefill_size=min(i.chunked_prefill_size for i in infos),
        vocab_size=first.vocab_size,
        eos_token_ids=first.eos_token_ids,
        attention=first.attention.to_json(),
        plan=plan,
        graph_kind=executor.graph_kind() if plan.enabled else None,
        captures=tuple(RankCapture(r, tuple(s)) for r, s in sorted(captures.items())),
    )
