"""What the three graph runners share: static buffers, one graph pool, timed captures."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from service.buckets import BucketPlan, ReplayDecision
from service.capture_result import CaptureStat
from service.commands import GraphKind
from service.errors import CaptureFailed
from service.model.llama import CausalLM
from service.ranks.attention.base import AttentionBackend
from service.ranks.forward_batch import BatchLayout, ForwardBatch
from service.ranks.runners.base import PrefillRunner
from service.ranks.runners.graph_capture import CapturedCall, timed_capture
from service.ranks.runners.static_buffers import PrefillStaticBuffers


class GraphRunner(PrefillRunner):
    """Captures the agreed buckets (largest first, one pool) and replays through static buffers.

    ``num_slots`` is the request axis of the captured graphs: S for ``full`` (fixed), and for
    the segment backends the real request count of each batch (their graphs are token-axis only).
    """

    def __init__(
        self,
        plan: BucketPlan,
        model: CausalLM,
        eager_attention: AttentionBackend,
        graph_attention: AttentionBackend,
        device: torch.device,
    ) -> None:
        self.plan = plan
        self.model = model
        self.eager_attention = eager_attention
        self.graph_attention = graph_attention
        self.device = device
        self.buffers = PrefillStaticBuffers.allocate(
            max(plan.bucket_sizes), plan.capture_request_capacity, device
        )
        self.pool: Any = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._captured: dict[int, Any] = {}

    @property
    def graph_kind(self) -> GraphKind:
        return "cuda" if self.device.type == "cuda" else "cpu"

    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured))

    @abstractmethod
    def captured_calls(self, bucket: int) -> list[CapturedCall]:
        """The graphs captured for ``bucket``."""

    def replayed_calls(self, bucket: int, layout: BatchLayout) -> list[CapturedCall]:
        """The graphs a replay of ``bucket`` over a batch of this layout runs, in order."""
        return self.captured_calls(bucket)

    def forget(self, num_tokens: int) -> None:
        self._captured.pop(num_tokens, None)

    def capture_bucket(self, num_tokens: int) -> CaptureStat:
        if num_tokens not in self.plan.bucket_sizes:
            raise CaptureFailed(f"bucket {num_tokens} is not in the agreed plan")
        lens = self.plan.bucket(num_tokens).capture_seq_lens
        captured, stat = timed_capture(
            num_tokens, self.device, lambda: self._capture(num_tokens, lens)
        )
        self._captured[num_tokens] = captured
        return stat

    def run(self, batch: ForwardBatch, decision: ReplayDecision) -> torch.Tensor:
        bucket = decision.bucket
        if bucket not in self._captured:
            raise CaptureFailed(f"bucket {bucket} was not captured")
        return self._replay(bucket, self._captured[bucket], batch)[: batch.num_tokens]

    @abstractmethod
    def _capture(self, bucket: int, capture_seq_lens: tuple[int, ...]) -> Any: ...

    @abstractmethod
    def _replay(self, bucket: int, captured: Any, batch: ForwardBatch) -> torch.Tensor: ...
