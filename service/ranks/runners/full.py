"""`full`: the whole forward, attention included, captured per bucket as a short chain of graphs.

The request axis is fixed at S slots at capture and at replay; slots without a request are
zero-length sentinels. Attention must be graph-safe (fixed shapes, lengths read from device
tensors): the backend's ``graph_attention``. A backend that plans on the host (FlashInfer's
CUDA-graph mode) does so in ``prepare``, outside the graph, before capture and every replay.
A backend with graph variants (FlashInfer: ragged for batches without a cached prefix, paged
on a prefix) gets one chain per bucket and variant; a replay runs the one its layout selects.

Why a chain and not one graph: the device starts a graph only when the host's launch call for
it returns, and that call costs about a microsecond per node (measured on the H200:
``benchmarks/graph_launch.py``, 345 nodes 410-530 us). One graph of the whole forward (about
320 nodes for 28 layers) made the device wait that long at every replay, a fifth of a
small-bucket prefill. The chain's first graph holds one layer, so the device starts after a
launch of about a dozen nodes, and each next graph holds at most twice the layers of the one
before (:func:`launch_spans`): the host launches it while the device runs the previous ones,
which take several times longer per layer than their launch. The kernels are those of one
graph, in the same order, from one memory pool; each graph leaves the residual and the next
layer's attention inputs in the runner's state buffers (the residual is copied there once, after
the embedding; the next q, k, v are projected there), where the next graph reads them.

Before those spans the chain has a *head*: the embedding and layer 0 up to its attention (K/V
stored). It reads no attention plan, so a replay launches it right after the token copy and
plans attention on the host while the device runs it (as ``breakable`` does with its first
segment); before, the device waited for the whole plan with nothing to do.
"""

from __future__ import annotations

from typing import Any

import torch

from service.ranks.forward_batch import BatchLayout, ForwardBatch
from service.ranks.runners.graph_base import GraphRunner
from service.ranks.runners.graph_capture import CapturedCall
from service.ranks.runners.state_buffers import StateBuffers

SPAN_GROWTH = 2  # each graph of the chain holds at most this many times the previous one's layers


def launch_spans(num_layers: int, growth: int = SPAN_GROWTH) -> tuple[tuple[int, int], ...]:
    """The layer ranges [start, stop) of a forward's chain of graphs: 1, then at most ``growth``
    times the previous span's layers, covering ``num_layers`` in order (28 layers: 1, 2, 4, 8,
    13)."""
    if num_layers < 1 or growth < 1:
        raise ValueError(f"need at least one layer and growth >= 1, got {num_layers}, {growth}")
    spans: list[tuple[int, int]] = []
    start, size = 0, 1
    while start < num_layers:
        stop = min(num_layers, start + size)
        spans.append((start, stop))
        start, size = stop, size * growth
    return tuple(spans)


class FullGraphRunner(GraphRunner):
    name = "full"

    @property
    def num_slots(self) -> int:
        return self.plan.capture_request_capacity

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the state between two graphs of a chain, shared by every bucket, variant and chain
        self.state = StateBuffers.allocate(self.model, self.buffers.max_tokens, self.device)

    def _capture(self, bucket: int, capture_seq_lens: tuple[int, ...]) -> Any:
        if not self.graph_attention.graph_safe:
            raise ValueError(f"attention backend {self.graph_attention.name} is not graph-safe")
        batch = self.buffers.load_synthetic(capture_seq_lens, bucket, self.num_slots)
        attention, model, state = self.graph_attention, self.model, self.state
        ids, positions = batch.input_ids, batch.positions
        qkv = state.qkv[:bucket]
        captured: dict[str, list[CapturedCall]] = {}
        for variant in attention.graph_variants:  # one chain each, from the one pool
            attention.prepare(batch, bucket, variant)

            def head(variant: str = variant) -> None:
                # the embedding and layer 0 up to its attention (K/V stored): no attention
                # plan read, so a replay launches it before planning
                bound = attention.bind_variant(batch, variant)
                state.keep(bucket, model.first_segment(ids, positions, bound, qkv_out=qkv))

            chain = [CapturedCall(head, self.device, self.pool, self.stream)]
            for start, stop in launch_spans(len(model.layers)):

                def span(start: int = start, stop: int = stop, variant: str = variant) -> Any:
                    # bind inside the captured function: the per-forward attention layout is
                    # part of the graph, recomputed from the static buffers at every replay
                    if start == 0:  # device work on the plan, before layer 0's attention
                        attention.graph_prologue(bucket, variant)
                    bound = attention.bind_variant(batch, variant)
                    first = state.state(bucket)  # where the previous graph left it
                    got = model.forward_span(start, stop, first, positions, bound, qkv_out=qkv)
                    if isinstance(got, torch.Tensor):  # the last span: final hidden states
                        return got
                    state.keep(bucket, got)
                    return None

                chain.append(CapturedCall(span, self.device, self.pool, self.stream))
            captured[variant] = chain
        return captured

    def _replay(self, bucket: int, captured: Any, batch: ForwardBatch) -> torch.Tensor:
        variant = self.graph_attention.graph_variant(batch.layout)
        if self.graph_attention.graph_reads_requests:
            view = self.buffers.copy_from(batch, bucket, self.num_slots)
        else:  # attention plans from the host layout: the graphs read token rows only
            view = self.buffers.copy_tokens(batch, bucket)
        head, *spans = captured[variant]
        head.replay()  # the device runs it while the host plans attention
        self.graph_attention.prepare(view, bucket, variant, self.num_slots)
        for call in spans:
            call.replay()
        return spans[-1].out

    def captured_calls(self, bucket: int) -> list[CapturedCall]:
        return [call for chain in self._captured[bucket].values() for call in chain]

    def replayed_calls(self, bucket: int, layout: BatchLayout) -> list[CapturedCall]:
        return list(self._captured[bucket][self.graph_attention.graph_variant(layout)])

    def forget(self, num_tokens: int) -> None:
        super().forget(num_tokens)
        self.graph_attention.forget(num_tokens)
