"""The prefill runner interface: capture the agreed buckets, say whether a batch can replay, run.

Graph runners (full, breakable, tc_piecewise) and the eager runner implement it, so the rank
worker never branches on the backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from service.buckets import ReplayDecision
from service.capture_result import CaptureStat
from service.commands import GraphKind
from service.errors import CaptureFailed
from service.ranks.forward_batch import ForwardBatch


class PrefillRunner(ABC):
    """Runs one prefill batch. ``run`` returns final hidden states for the real tokens (N, H)."""

    name: str = "base"

    @property
    @abstractmethod
    def graph_kind(self) -> GraphKind | None:
        """``cuda`` for real CUDA graphs, ``cpu`` for static-buffer replay on CPU, None eager."""

    def capture_bucket(self, num_tokens: int) -> CaptureStat:
        raise CaptureFailed(f"{self.name} runner captures nothing")

    def captured_buckets(self) -> tuple[int, ...]:
        return ()

    def forget(self, num_tokens: int) -> None:
        """Drop a captured bucket (its capture failed on another rank); eager has none."""
        return None

    def can_replay(self, decision: ReplayDecision) -> bool:
        return decision.hit and decision.bucket in self.captured_buckets()

    @abstractmethod
    def run(self, batch: ForwardBatch, decision: ReplayDecision) -> torch.Tensor: ...
