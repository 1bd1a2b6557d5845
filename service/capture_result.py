"""What one rank's capture of one bucket came to: its cost, or why it failed (typed, picklable).

No torch import: these travel from the ranks to the coordinator (through Ray at tp > 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from service.buckets import BucketPlan
from service.decode_sizes import DecodePlan

GraphSet = Literal["prefill", "decode"]  # prefill buckets, or decode batch sizes


@dataclass(frozen=True)
class CaptureStat:
    """Per-bucket capture cost on one rank."""

    num_tokens: int
    seconds: float
    memory_bytes: int  # device memory the bucket's graphs added (0 on CPU)

    def to_json(self) -> dict:
        return {
            "num_tokens": self.num_tokens,
            "seconds": round(self.seconds, 4),
            "memory_bytes": self.memory_bytes,
        }


@dataclass(frozen=True)
class CaptureFailure:
    """A bucket this rank could not capture; the coordinator drops it on every rank."""

    num_tokens: int
    rank: int
    error: str  # the exception's type name
    message: str
    # the failure left this rank's collectives out of step with its peers (a collective inside
    # the capture timed out or broke): the process group cannot be trusted any more
    desync: bool = False

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.error}: {self.message}"


CaptureResult = CaptureStat | CaptureFailure


@dataclass(frozen=True)
class RankPlans:
    """What one rank could capture: its legal prefill buckets and decode sizes."""

    prefill: BucketPlan
    decode: DecodePlan
