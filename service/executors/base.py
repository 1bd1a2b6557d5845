"""How the coordinator reaches its ranks: the interface every executor implements.

Every method runs the same call on every rank, in the same order, and waits with a timeout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from service.buckets import BucketPlan
from service.capture_result import CaptureResult, GraphSet, RankPlans
from service.commands import ForwardCommand, ForwardResult
from service.decode_sizes import DecodePlan
from service.rank_info import RankInfo


class Executor(ABC):
    kind: str = "local"  # "local" (in this process) or "ray" (an actor per rank)

    @abstractmethod
    def infos(self) -> list[RankInfo]: ...

    @abstractmethod
    def local_plans(self) -> list[RankPlans]: ...

    @abstractmethod
    def build_runners(self, prefill: BucketPlan, decode: DecodePlan) -> None: ...

    @abstractmethod
    def capture(self, kind: GraphSet, size: int) -> list[CaptureResult]:
        """Capture one prefill bucket or decode size on every rank, together; one result per
        rank. A size that failed on any rank is forgotten on every rank before this returns."""

    @abstractmethod
    def execute(
        self, cmd: ForwardCommand, on_launched: Callable[[], None] | None = None
    ) -> ForwardResult:
        """Run one forward on every rank. ``on_launched``, when given, is called once, when
        this process is about to wait for the step (its device work queued, or the ranks
        reached): host work done there overlaps the device. Not called if execute raises
        before that point."""

    def graph_kind(self) -> str | None:
        return None

    def freeze_heaps(self) -> list[int]:
        """Start-up is over: ranks in processes of their own freeze their start-up heaps
        (service.heap); returns each one's frozen object count. In-process ranks share the
        server's heap, which the server freezes itself."""
        return []

    def alive(self) -> str | None:
        """None when every rank is alive, else the reason."""
        return None

    def shutdown(self) -> None:
        return None
