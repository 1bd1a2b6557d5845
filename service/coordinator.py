"""Start-up agreement across ranks: one legal bucket set, captured in lockstep, largest first.

1. Every rank resolves its own legal sets (from its own request pool and memory): prefill
   buckets and decode sizes.
2. The coordinator agrees on the intersections (service.buckets.agree_plans,
   service.decode_sizes.agree_decode_plans).
3. Every rank builds its runners for exactly those sets and captures size by size, prefill
   buckets first, then decode sizes, in the same order; each capture call returns on every rank
   before the next starts (the executor's barrier). A size that fails on any rank is dropped on
   all of them.
4. If nothing survives, one warning names backend, context length and request capacity, and
   prefill (or decode) runs eagerly; start-up does not fail for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from service.buckets import GRAPH_BACKENDS, agree_plans, drop_buckets
from service.capture_result import CaptureFailure, CaptureStat, GraphSet
from service.config import EngineConfig
from service.decode_sizes import agree_decode_plans, drop_decode_sizes
from service.errors import RankFailure
from service.executors.base import Executor
from service.rank_info import agree_rank_infos
from service.resolved import RankCapture, ResolvedConfig

log = logging.getLogger("service.coordinator")


def capture_set(
    executor: Executor, kind: GraphSet, sizes: list[int], describe: Callable[[int], str]
) -> tuple[dict[int, str], list[RankCapture]]:
    """Capture ``sizes`` (largest first: one shared pool) on every rank, in lockstep; a size that
    fails anywhere is forgotten everywhere. Returns the failures and each rank's stats."""
    what = "prefill graph" if kind == "prefill" else "decode graph"
    failures: dict[int, str] = {}
    stats: dict[int, list[CaptureStat]] = {}
    t_all = time.perf_counter()
    for n, size in enumerate(sizes, 1):
        results = executor.capture(kind, size)
        errors = [r for r in results if isinstance(r, CaptureFailure)]
        if any(e.desync for e in errors):
            # a rank failed before a collective its peers waited in: their process groups are
            # out of step, so no later graph or forward can be trusted; the root cause first
            causes = sorted(errors, key=lambda e: e.desync)
            raise RankFailure(
                f"capture of {kind} size {size} left the ranks' collectives out of step: "
                + "; ".join(str(e) for e in causes)
            )
        if errors:
            failures[size] = "; ".join(str(e) for e in errors)
            log.warning("Capture %s: %s failed: %s", what, describe(size), failures[size])
            continue
        ok = [r for r in results if isinstance(r, CaptureStat)]
        for rank, stat in enumerate(ok):
            stats.setdefault(rank, []).append(stat)
        log.info(
            "Capture %s [%d/%d]: %s, %.3f s, %.1f MiB",
            what,
            n,
            len(sizes),
            describe(size),
            max(s.seconds for s in ok),
            max(s.memory_bytes for s in ok) / 2**20,
        )
    if sizes:
        log.info(
            "Capture %ss done: %d of %d in %.2f s (%s), %d dropped",
            what,
            len(sizes) - len(failures),
            len(sizes),
            time.perf_counter() - t_all,
            executor.graph_kind() or "cpu",
            len(failures),
        )
    return failures, [RankCapture(rank, tuple(s)) for rank, s in sorted(stats.items())]


def start_up(cfg: EngineConfig, executor: Executor) -> ResolvedConfig:
    infos = executor.infos()
    limits = agree_rank_infos(infos)
    plans = executor.local_plans()
    prefill = agree_plans([p.prefill for p in plans])
    decode = agree_decode_plans([p.decode for p in plans])
    executor.build_runners(prefill, decode)

    def bucket(size: int) -> str:
        lens = prefill.bucket(size).capture_seq_lens
        return f"bucket {size} as {sum(1 for x in lens if x)} synthetic requests {list(lens)}"

    failed, captures = capture_set(
        executor, "prefill", sorted(prefill.bucket_sizes, reverse=True), bucket
    )
    prefill = drop_buckets(prefill, failed)
    failed, decode_captures = capture_set(
        executor, "decode", sorted(decode.sizes, reverse=True), lambda n: f"decode size {n}"
    )
    decode = drop_decode_sizes(decode, failed)
    if not prefill.enabled and prefill.backend in GRAPH_BACKENDS:
        log.warning("Disable prefill graphs: %s", prefill.disabled_reason)
    if not decode.enabled:
        log.warning("Decode runs eagerly: %s", decode.disabled_reason)
    kind = executor.graph_kind() or ("cuda" if limits.device.startswith("cuda") else "cpu")
    executor.freeze_heaps()  # ranks in their own processes: no collection over start-up's heap
    return ResolvedConfig(
        config=cfg,
        executor=executor.kind,
        tp=len(infos),
        limits=limits,
        plan=prefill,
        graph_kind=kind if prefill.enabled else None,
        captures=tuple(captures),
        decode=decode,
        decode_graph_kind=kind if decode.enabled else None,
        decode_captures=tuple(decode_captures),
    )
