"""Test-only fault injection: rank actors and executors that misbehave on purpose.

Production classes carry no fault hooks; these subclasses add them. A faulty actor class is built
inside a function, so Ray ships it by value to its worker processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from service.config import EngineConfig
from service.executors.local import LocalExecutor
from service.ranks.actor import RankActor

ERRORS: dict[str, type[Exception]] = {
    "RuntimeError": RuntimeError,
    "ValueError": ValueError,
    "IndexError": IndexError,
    "KeyError": KeyError,
}


@dataclass(frozen=True)
class RankFaults:
    max_running_requests: int | None = None  # a smaller request pool on this rank
    fail_capture_buckets: tuple[int, ...] = ()  # captures of these buckets raise ...
    capture_error: str = "RuntimeError"  # ... this exception, from inside the runner, ...
    # ... at the "end" of the capture (its collectives done: graph instantiation, a memory check)
    # or at its "start" (before its first collective: its peers then wait inside one)
    fail_capture_at: str = "end"
    arrive_late_s: float = 0.0  # sleep before entering a capture (before the entry barrier)
    capture_extra_s: float = 0.0  # sleep inside a capture (between the barriers)
    hang_execute_from: int | None = None  # the n-th forward (1-based) and later hang ...
    hang_s: float = 600.0  # ... this long


def failing_capture(
    capture: Callable, faults: RankFaults, timeline: list[tuple[str, int, float]] | None = None
) -> Callable:
    """``capture`` (a runner's capture_bucket) with the faults of ``faults`` injected."""

    def run(num_tokens: int):
        if timeline is not None:
            timeline.append(("capture_start", num_tokens, time.time()))
        time.sleep(faults.capture_extra_s)
        fail = num_tokens in faults.fail_capture_buckets
        if fail and faults.fail_capture_at == "start":
            raise ERRORS[faults.capture_error](f"injected failure for bucket {num_tokens}")
        out = capture(num_tokens)
        if fail:
            raise ERRORS[faults.capture_error](f"injected failure for bucket {num_tokens}")
        if timeline is not None:
            timeline.append(("capture_end", num_tokens, time.time()))
        return out

    return run


def faulty_actor(faults: dict[int, RankFaults]) -> type[RankActor]:
    """A RankActor class whose rank r misbehaves as ``faults[r]`` says."""

    class FaultyRankActor(RankActor):
        def __init__(self, cfg: EngineConfig, rank: int, world_size: int) -> None:
            super().__init__(cfg, rank, world_size)
            self.faults = faults.get(rank, RankFaults())
            self.events: list[tuple[str, int, float]] = []
            self.forwards = 0

        def rank_config(self) -> EngineConfig:
            if self.faults.max_running_requests is None:
                return self.cfg
            return replace(self.cfg, max_running_requests=self.faults.max_running_requests)

        def build_runners(self, prefill, decode):
            kind = super().build_runners(prefill, decode)
            runner = self.worker.runner
            runner.capture_bucket = failing_capture(runner.capture_bucket, self.faults, self.events)
            return kind

        def capture(self, kind, size: int):
            if kind != "prefill":  # the faults are prefill captures'
                return super().capture(kind, size)
            time.sleep(self.faults.arrive_late_s)
            self.events.append(("arrive", size, time.time()))
            out = super().capture(kind, size)
            self.events.append(("return", size, time.time()))
            return out

        def execute(self, cmd):
            self.forwards += 1
            start = self.faults.hang_execute_from
            if start is not None and self.forwards >= start:
                time.sleep(self.faults.hang_s)
            return super().execute(cmd)

        def timeline(self) -> list[tuple[str, int, float]]:
            return list(self.events)

    return FaultyRankActor


class FaultyLocalExecutor(LocalExecutor):
    """The in-process executor with capture faults, and a forward that raises from the n-th."""

    def __init__(
        self,
        cfg: EngineConfig,
        faults: RankFaults = RankFaults(),
        raise_on_forward: int | None = None,
        forward_error: Exception | None = None,
        hang_on_forward: int | None = None,
    ) -> None:
        super().__init__(cfg)
        self.faults = faults
        self.raise_on_forward = raise_on_forward
        self.hang_on_forward = hang_on_forward
        self.forward_error = forward_error or ValueError("injected forward failure")
        self.forwards = 0

    def build_runners(self, prefill, decode) -> None:
        super().build_runners(prefill, decode)
        runner = self.worker.runner
        runner.capture_bucket = failing_capture(runner.capture_bucket, self.faults)

    def execute(self, cmd, on_launched=None):
        self.forwards += 1
        if self.raise_on_forward is not None and self.forwards >= self.raise_on_forward:
            raise self.forward_error
        if self.hang_on_forward is not None and self.forwards >= self.hang_on_forward:
            time.sleep(3600)  # a device that never returns: only the watchdog notices
        return super().execute(cmd, on_launched)


__all__ = ["FaultyLocalExecutor", "RankFaults", "faulty_actor"]
