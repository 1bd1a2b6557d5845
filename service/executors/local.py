"""One rank in this process (tp=1): no Ray, no process group."""

from __future__ import annotations

from collections.abc import Callable

from service.buckets import BucketPlan
from service.capture_result import CaptureFailure, CaptureResult, GraphSet, RankPlans
from service.commands import ForwardCommand, ForwardResult
from service.config import EngineConfig
from service.decode_sizes import DecodePlan
from service.executors.base import Executor
from service.rank_info import RankInfo


class LocalExecutor(Executor):
    kind = "local"

    def __init__(self, cfg: EngineConfig) -> None:
        from service.ranks.startup import set_up_rank
        from service.ranks.worker import RankWorker

        self.worker = RankWorker(set_up_rank(cfg))

    def infos(self) -> list[RankInfo]:
        return [self.worker.info]

    def local_plans(self) -> list[RankPlans]:
        return [self.worker.resolve_local_plans()]

    def build_runners(self, prefill: BucketPlan, decode: DecodePlan) -> None:
        self.worker.build_runners(prefill, decode)

    def capture(self, kind: GraphSet, size: int) -> list[CaptureResult]:
        result = self.worker.capture(kind, size)
        if isinstance(result, CaptureFailure):
            self.worker.forget(kind, size)
        return [result]

    def execute(
        self, cmd: ForwardCommand, on_launched: Callable[[], None] | None = None
    ) -> ForwardResult:
        return self.worker.execute(cmd, on_launched)

    def graph_kind(self) -> str | None:
        return self.worker.graph_kind
