"""`tc_piecewise`: torch.compile splits the forward at attention; pieces are captured per bucket.

For each bucket, dynamo traces the forward at that static shape; attention is the opaque custom
op ``capture_service::attention``. The traced FX graph is split at every attention node
(``torch.fx.passes.split_module``); each non-attention piece is compiled (inductor on CUDA by
default, the FX graph as traced on CPU, where inductor's C++ build would dominate a 2-core CI)
and captured as its own graph. Attention runs eagerly between pieces with the live batch.

A fresh code object per bucket gives each bucket its own dynamo cache entry, so buckets never
evict each other (dynamo's recompile limit) and none silently falls back to eager.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from service.ranks.attention.custom_op import attention_context, op_attend
from service.ranks.forward_batch import ForwardBatch
from service.ranks.runners.graph_base import GraphRunner
from service.ranks.runners.graph_capture import CapturedCall

_ATTENTION_TARGET = torch.ops.capture_service.attention.default


def _is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (
        _ATTENTION_TARGET,
        torch.ops.capture_service.attention,
    )


class PieceGraph(nn.Module):
    """One compiled piece; captured as a graph on the first call after ``arm()``.

    Inputs are copied into static clones unless they already are the static tensors (outputs
    of the previous piece, or the runner's static buffers), which is the common case.
    """

    def __init__(self, fn: Any, runner: TcPiecewiseGraphRunner) -> None:
        super().__init__()
        self.fn = fn
        self.runner = runner
        self.static_inputs: list[Any] | None = None
        self.captured: CapturedCall | None = None

    def forward(self, *args: Any) -> Any:
        if self.captured is None:
            if not self.runner.capturing:
                return self.fn(*args)  # dynamo's own first run during tracing/compile
            self.static_inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            static = self.static_inputs
            self.captured = CapturedCall(
                lambda: self.fn(*static), self.runner.device, self.runner.pool, self.runner.stream
            )
            return self.captured.out
        for dst, src in zip(self.static_inputs, args, strict=True):
            if isinstance(src, torch.Tensor) and src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
        return self.captured.replay()


class TcPiecewiseGraphRunner(GraphRunner):
    name = "tc_piecewise"

    def __init__(self, *args: Any, piece_compiler: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if piece_compiler == "auto":
            piece_compiler = "inductor" if self.device.type == "cuda" else "eager"
        self.piece_compiler = piece_compiler
        self.capturing = False
        self.num_pieces: dict[int, int] = {}

    def _backend(self, bucket: int):
        def backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]):
            counter = {"part": 0}

            def partition(node: fx.Node) -> int:
                if _is_attention(node):
                    counter["part"] += 1
                    part = counter["part"]
                    counter["part"] += 1
                    return part
                return counter["part"]

            split = split_module(gm, None, partition, keep_original_order=True)
            pieces = 0
            for name, sub in list(split.named_children()):
                if any(_is_attention(n) for n in sub.graph.nodes):
                    continue  # attention stays eager
                fn = sub
                if self.piece_compiler == "inductor":
                    fn = torch.compile(sub, backend="inductor", dynamic=False, fullgraph=True)
                split.register_module(name, PieceGraph(fn, self))
                pieces += 1
            self.num_pieces[bucket] = pieces
            return split.forward

        return backend

    def _forward_code(self, bucket: int):
        model = self.model

        def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions, op_attend)

        code = forward.__code__.replace(co_name=f"tc_piecewise_bucket_{bucket}")
        fn = types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)
        return torch.compile(fn, backend=self._backend(bucket), dynamic=False, fullgraph=True)

    def _capture(self, bucket: int, capture_seq_lens: tuple[int, ...]) -> Any:
        real = tuple(n for n in capture_seq_lens if n > 0)
        batch = self.buffers.load_synthetic(real, bucket, len(real))
        compiled = self._forward_code(bucket)
        ids, pos = self.buffers.input_ids[:bucket], self.buffers.positions[:bucket]
        with attention_context(self.eager_attention, batch):
            compiled(ids, pos)  # trace and compile the pieces for this shape
            self.capturing = True
            try:
                compiled(ids, pos)  # each piece warms up and is captured
            finally:
                self.capturing = False
        return compiled

    def _replay(self, bucket: int, captured: Any, batch: ForwardBatch) -> torch.Tensor:
        view = self.buffers.copy_from(batch, bucket, batch.layout.num_requests)
        with attention_context(self.eager_attention, view):
            return captured(self.buffers.input_ids[:bucket], self.buffers.positions[:bucket])
