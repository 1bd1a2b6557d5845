"""`full`: the whole forward, attention included, as one captured graph per bucket.

The request axis is fixed at S slots at capture and at replay; slots without a request are
zero-length sentinels. Attention must be graph-safe (fixed shapes, lengths read from device
tensors): the backend's ``graph_attention``. A backend that plans on the host (FlashInfer's
CUDA-graph mode) does so in ``prepare``, outside the graph, before capture and every replay.
A backend with graph variants (FlashInfer: ragged for batches without a cached prefix, paged
on a prefix) gets one graph per bucket and variant; a replay runs the one its layout selects.
"""

from __future__ import annotations

from typing import Any

import torch

from service.ranks.forward_batch import BatchLayout, ForwardBatch
from service.ranks.runners.graph_base import GraphRunner
from service.ranks.runners.graph_capture import CapturedCall


class FullGraphRunner(GraphRunner):
    name = "full"

    @property
    def num_slots(self) -> int:
        return self.plan.capture_request_capacity

    def _capture(self, bucket: int, capture_seq_lens: tuple[int, ...]) -> Any:
        if not self.graph_attention.graph_safe:
            raise ValueError(f"attention backend {self.graph_attention.name} is not graph-safe")
        batch = self.buffers.load_synthetic(capture_seq_lens, bucket, self.num_slots)
        attention = self.graph_attention
        captured: dict[str, CapturedCall] = {}
        for variant in attention.graph_variants:  # one graph each, from the one pool
            attention.prepare(batch, bucket, variant)

            def forward(variant: str = variant) -> torch.Tensor:
                # bind inside the captured function: the per-forward attention layout is part
                # of the graph, recomputed from the static buffers at every replay
                bound = attention.bind_variant(batch, variant)
                return self.model(batch.input_ids, batch.positions, bound)

            captured[variant] = CapturedCall(forward, self.device, self.pool, self.stream)
        return captured

    def _replay(self, bucket: int, captured: Any, batch: ForwardBatch) -> torch.Tensor:
        variant = self.graph_attention.graph_variant(batch.layout)
        view = self.buffers.copy_from(batch, bucket, self.num_slots)
        self.graph_attention.prepare(view, bucket, variant)
        return captured[variant].replay()

    def captured_calls(self, bucket: int) -> list[CapturedCall]:
        return list(self._captured[bucket].values())

    def replayed_calls(self, bucket: int, layout: BatchLayout) -> list[CapturedCall]:
        return [self._captured[bucket][self.graph_attention.graph_variant(layout)]]

    def forget(self, num_tokens: int) -> None:
        super().forget(num_tokens)
        self.graph_attention.forget(num_tokens)
