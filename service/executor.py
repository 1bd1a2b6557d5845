"""How the coordinator reaches its ranks: in-process at tp=1, Ray actors at tp>1.

Every method runs the same call on every rank, in the same order, and waits with a timeout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from service.buckets import BucketPlan
from service.commands import ForwardCommand, ForwardResult
from service.config import EngineConfig


class RankFailure(RuntimeError):
    """A rank died or timed out; the engine is unhealthy until rebuilt."""


class Executor(ABC):
    kind: str = "local"  # "local" (in this process) or "ray" (an actor per rank)

    @abstractmethod
    def infos(self) -> list: ...

    @abstractmethod
    def local_plans(self) -> list[BucketPlan]: ...

    @abstractmethod
    def build_runners(self, plan: BucketPlan) -> None: ...

    @abstractmethod
    def capture_bucket(self, plan: BucketPlan, num_tokens: int) -> list: ...

    @abstractmethod
    def execute(self, cmd: ForwardCommand) -> ForwardResult: ...

    def graph_kind(self) -> str | None:
        return None

    def alive(self) -> str | None:
        """None when every rank is alive, else the reason."""
        return None

    def shutdown(self) -> None:
        return None


class LocalExecutor(Executor):
    """One rank in this process (tp=1): no Ray, no process group."""

    def __init__(self, cfg: EngineConfig) -> None:
        from service.ranks.worker import RankWorker

        self.worker = RankWorker(cfg)

    def infos(self) -> list:
        return [self.worker.info]

    def local_plans(self) -> list[BucketPlan]:
        return [self.worker.resolve_local_plan()]

    def build_runners(self, plan: BucketPlan) -> None:
        self.worker.build_runner(plan)

    def capture_bucket(self, plan: BucketPlan, num_tokens: int) -> list:
        return [self.worker.capture_bucket(plan, num_tokens)]

    def execute(self, cmd: ForwardCommand) -> ForwardResult:
        return self.worker.execute(cmd)

    def graph_kind(self) -> str | None:
        return self.worker.graph_kind
