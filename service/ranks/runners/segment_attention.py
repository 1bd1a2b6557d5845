"""Where a segment runner's attention launches come from, once per forward.

Both segment backends (``breakable``, ``tc_piecewise``) run attention eagerly between their
graphs, planned for the live batch. With FlashInfer and a batch without a cached prefix (the
common prefill) the plan goes through a CUDA-graph-mode ragged wrapper per bucket and head shape
(:class:`FlashInferGraphAttention`, the one ``full`` captures): its plan buffers and plan info do
not change from plan to plan, so a replan is one copy and FlashInfer's compiled scheduler
(:class:`~service.ranks.attention.flashinfer_replan.RaggedReplan`, no Python ``plan``) and the
recorded kernel calls of the bucket are made once and kept. On the H200's host FlashInfer's
eager ``plan`` and the per-forward recording cost about 0.2 ms before the first layer's attention
could launch, with the device waiting. Everything else (a cached prefix, torch attention, CPU)
binds the eager backend and resolves its launches per forward.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.ranks.attention.base import AttendCalls, AttentionBackend, Launcher
from service.ranks.attention.flashinfer_backend import FlashInferAttention, FlashInferGraphAttention
from service.ranks.forward_batch import ForwardBatch
from service.ranks.runners.static_buffers import PrefillStaticBuffers
from service.ranks.runners.tape import bound


class SegmentAttention:
    def __init__(self, eager: AttentionBackend, num_slots: int) -> None:
        self.eager = eager
        self.num_slots = num_slots  # the request axis of the planned wrappers (sentinels padded)
        self.planned = _planned(eager)

    def capture(self, buffers: PrefillStaticBuffers, real: tuple[int, ...], bucket: int) -> None:
        """The first plan of the bucket's planned wrappers, over its capture layout (its lengths
        fill the bucket, as FlashInfer's CUDA-graph mode requires of a first plan)."""
        if self.planned is not None:
            self.planned.prepare(buffers.load_synthetic(real, bucket, self.num_slots), bucket,
                                 "ragged")  # fmt: skip
            # later plans: one graph launch (indptr copy + device planner) where it runs
            self.planned.capture_plan_graphs(bucket)

    def forget(self, bucket: int) -> None:
        if self.planned is not None:
            self.planned.forget(bucket)

    def load(self, buffers: PrefillStaticBuffers, batch: ForwardBatch, bucket: int) -> ForwardBatch:
        """The live batch in the static buffers. Planned attention takes its layout from the
        host and the segments read token rows only, so only those are copied; eager attention
        binds to the request tensors too."""
        if self._planned_for(batch):
            return buffers.copy_tokens(batch, bucket)
        return buffers.copy_from(batch, bucket, batch.layout.num_requests)

    def launches(self, view: ForwardBatch, bucket: int, calls: AttendCalls) -> Sequence[Launcher]:
        """This forward's launch of each call, planned for the batch in ``view``."""
        if self.planned is not None and self._planned_for(view):
            self.planned.prepare(view, bucket, "ragged", self.num_slots)
            return self.planned.ragged_launchers(bucket, calls, view.layout.num_tokens)
        return bound(self.eager.bind(view)).launchers(calls)

    def _planned_for(self, batch: ForwardBatch) -> bool:
        return self.planned is not None and not any(batch.layout.prefix_lens)


def _planned(eager: AttentionBackend) -> FlashInferGraphAttention | None:
    if not isinstance(eager, FlashInferAttention):
        return None
    return FlashInferGraphAttention(
        eager.registry, eager.kv, eager.req_to_token, kernel=eager.kernel,
        workspace=eager.workspace, balanced=eager.balance is not None,
    )  # fmt: skip
