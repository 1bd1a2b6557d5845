"""One rank in this process (tp=1): no Ray, no process group."""

from __future__ import annotations

from service.buckets import BucketPlan
from service.capture_result import CaptureFailure, CaptureResult
from service.commands import ForwardCommand, ForwardResult
from service.config import EngineConfig
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

    def local_plans(self) -> list[BucketPlan]:
        return [self.worker.resolve_local_plan()]

    def build_runners(self, plan: BucketPlan) -> None:
        self.worker.build_runner(plan)

    def capture_bucket(self, plan: BucketPlan, num_tokens: int) -> list[CaptureResult]:
        result = self.worker.capture_bucket(plan, num_tokens)
        if isinstance(result, CaptureFailure):
            self.worker.forget_bucket(num_tokens)
        return [result]

    def execute(self, cmd: ForwardCommand) -> ForwardResult:
        return self.worker.execute(cmd)

    def graph_kind(self) -> str | None:
        return self.worker.graph_kind
