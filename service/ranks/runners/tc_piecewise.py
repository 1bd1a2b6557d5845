"""`tc_piecewise`: torch.compile splits the forward at attention; pieces are captured per bucket.

Dynamo traces the forward once with a symbolic token count; attention is the opaque custom op
``capture_service::attention``. The traced FX graph is split at every attention node
(``torch.fx.passes.split_module``); each non-attention piece is compiled once for dynamic shapes
(inductor on CUDA by default, the FX graph as traced on CPU, where inductor's C++ build would
dominate a 2-core CI) and captured as its own graph for every bucket. Attention runs eagerly
between pieces with the live batch.

Buckets that take the same Python path through the model share one compile: the MLP runs in
``MLP_TOKEN_CHUNK`` token chunks, so the number of chunks is part of the traced graph. Each such
shape class gets its own code object, hence its own dynamo cache entry, so classes never evict
each other (dynamo's recompile limit) and none silently falls back to eager.
"""

from __future__ import annotations

import operator
import types
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from service.model.llama import MLP_TOKEN_CHUNK
from service.ranks.attention.custom_op import attention_context, op_attend
from service.ranks.forward_batch import ForwardBatch
from service.ranks.runners.base import CaptureFailed
from service.ranks.runners.graph_base import GraphRunner
from service.ranks.runners.graph_capture import CapturedCall

_ATTENTION_TARGET = torch.ops.capture_service.attention.default


def _is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (
        _ATTENTION_TARGET,
        torch.ops.capture_service.attention,
    )


class PieceGraph(nn.Module):
    """One compiled piece, captured as one graph per bucket while the runner captures.

    Memory: a piece's inputs and outputs live in buffers shared by all pieces and buckets
    (sized for the largest bucket, keyed by position, trailing shape and dtype), never in the
    graph itself. Inputs that already are such buffers (the previous piece's outputs, the
    runner's static inputs) are used in place; others (attention outputs) are copied into an
    input buffer. Outputs are computed first and then copied into output buffers, so a piece
    may overwrite the very buffer it read. An output that something later than the next piece
    still needs (``shareable`` False) stays owned by the graph.
    """

    def __init__(self, fn: Any, runner: TcPiecewiseGraphRunner, shareable: list[bool]) -> None:
        super().__init__()
        self.fn = fn
        self.runner = runner
        self.shareable = shareable
        self.captured: dict[int, tuple[list[Any], CapturedCall]] = {}  # bucket -> inputs, graph

    def _stage(self, args: tuple) -> list[Any]:
        staged = []
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor) or self.runner.is_static(a):
                staged.append(a)
            else:
                staged.append(self.runner.shared("in", i, a).copy_(a))
        return staged

    def _store(self, out: Any) -> Any:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        stored = []
        for i, o in enumerate(outs):
            share = i < len(self.shareable) and self.shareable[i]
            if share and isinstance(o, torch.Tensor) and o.dim() >= 1:
                stored.append(self.runner.shared("out", i, o).copy_(o))
            else:
                stored.append(o)
        return type(out)(stored) if isinstance(out, (tuple, list)) else stored[0]

    def forward(self, *args: Any) -> Any:
        bucket = self.runner.bucket
        entry = self.captured.get(bucket)
        if entry is None:
            if not self.runner.capturing:
                return self.fn(*args)  # the first run of a shape class: compiles the piece
            static = self._stage(args)
            call = CapturedCall(
                lambda: self._store(self.fn(*static)),
                self.runner.device,
                self.runner.pool,
                self.runner.stream,
            )
            self.captured[bucket] = (static, call)
            return call.out
        static, call = entry
        for dst, src in zip(static, args, strict=True):
            if isinstance(src, torch.Tensor) and src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
        return call.replay()


def shareable_outputs(split: fx.GraphModule) -> dict[str, list[bool]]:
    """Per piece: which outputs are dead once the next piece has run (so buffers can be reused).

    An output is shareable when every user comes before (or is) the next non-attention piece.
    """
    nodes = list(split.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    pieces = [
        n for n in nodes
        if n.op == "call_module"
        and not any(_is_attention(m) for m in getattr(split, n.target).graph.nodes)
    ]  # fmt: skip
    result: dict[str, list[bool]] = {}
    for j, node in enumerate(pieces):
        limit = pos[pieces[j + 1]] if j + 1 < len(pieces) else -1
        getitems = [
            u for u in node.users if u.op == "call_function" and u.target is operator.getitem
        ]
        if getitems and len(getitems) == len(node.users):
            width = max(g.args[1] for g in getitems) + 1
            flags = [False] * width
            for g in getitems:
                flags[g.args[1]] = limit >= 0 and all(pos[u] <= limit for u in g.users)
        else:
            flags = [limit >= 0 and all(pos[u] <= limit for u in node.users)]
        result[node.target] = flags
    return result


class TcPiecewiseGraphRunner(GraphRunner):
    name = "tc_piecewise"

    def __init__(self, *args: Any, piece_compiler: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if piece_compiler == "auto":
            piece_compiler = "inductor" if self.device.type == "cuda" else "eager"
        self.piece_compiler = piece_compiler
        self.capturing = False
        self.bucket: int | None = None  # the bucket being captured or replayed
        self.num_pieces: dict[int, int] = {}
        self.traces = 0  # dynamo traces (one per shape class when nothing recompiles)
        self._compiled: dict[int, Any] = {}  # shape class -> compiled forward
        self._pieces: dict[int, list[PieceGraph]] = {}
        self._shared: dict[tuple, torch.Tensor] = {}
        # Dynamo lifts parameters and buffers into graph inputs: they are static, never copied
        self._static_ptrs = {self.buffers.input_ids.data_ptr(), self.buffers.positions.data_ptr()}
        self._static_ptrs |= {t.data_ptr() for t in self.model.parameters()}
        self._static_ptrs |= {t.data_ptr() for t in self.model.buffers()}

    def shared(self, role: str, index: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer for ``like``'s leading rows, shared by every piece and bucket."""
        key = (role, index, tuple(like.shape[1:]), like.dtype)
        buf = self._shared.get(key)
        if like.shape[0] > self.buffers.max_tokens:
            raise CaptureFailed(
                f"piece tensor of {like.shape[0]} rows exceeds the largest bucket "
                f"{self.buffers.max_tokens}"
            )
        if buf is None:  # never reallocated: captured graphs keep the address
            shape = (self.buffers.max_tokens, *like.shape[1:])
            buf = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._shared[key] = buf
            self._static_ptrs.add(buf.data_ptr())
        return buf[: like.shape[0]]

    def is_static(self, t: torch.Tensor) -> bool:
        return t.data_ptr() in self._static_ptrs

    @staticmethod
    def shape_class(bucket: int) -> int:
        """Buckets of one class take the same path through the model (MLP chunk count)."""
        return -(-bucket // MLP_TOKEN_CHUNK)

    def _backend(self, shape_class: int):
        def backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]):
            self.traces += 1
            counter = {"part": 0}

            def partition(node: fx.Node) -> int:
                if _is_attention(node):
                    counter["part"] += 1
                    part = counter["part"]
                    counter["part"] += 1
                    return part
                return counter["part"]

            split = split_module(gm, None, partition, keep_original_order=True)
            shareable = shareable_outputs(split)
            pieces = 0
            for name, sub in list(split.named_children()):
                if any(_is_attention(n) for n in sub.graph.nodes):
                    continue  # attention stays eager
                fn = sub
                if self.piece_compiler == "inductor":
                    fn = torch.compile(sub, backend="inductor", dynamic=True, fullgraph=True)
                piece = PieceGraph(fn, self, shareable[name])
                split.register_module(name, piece)
                self._pieces.setdefault(shape_class, []).append(piece)
                pieces += 1
            self.num_pieces[shape_class] = pieces
            return split.forward

        return backend

    def _forward_code(self, shape_class: int):
        model = self.model

        def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions, op_attend)

        code = forward.__code__.replace(co_name=f"tc_piecewise_class_{shape_class}")
        fn = types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)
        return torch.compile(fn, backend=self._backend(shape_class), dynamic=None, fullgraph=True)

    def _inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos = self.buffers.input_ids[:bucket], self.buffers.positions[:bucket]
        for t in (ids, pos):  # one trace serves every bucket of the class
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return ids, pos

    def pieces_of(self, bucket: int) -> int:
        return self.num_pieces[self.shape_class(bucket)]

    def forget(self, num_tokens: int) -> None:
        super().forget(num_tokens)
        for piece in self._pieces.get(self.shape_class(num_tokens), []):
            piece.captured.pop(num_tokens, None)

    def _capture(self, bucket: int, capture_seq_lens: tuple[int, ...]) -> Any:
        real = tuple(n for n in capture_seq_lens if n > 0)
        batch = self.buffers.load_synthetic(real, bucket, len(real))
        cls = self.shape_class(bucket)
        first = cls not in self._compiled
        if first:
            self._compiled[cls] = self._forward_code(cls)
        compiled = self._compiled[cls]
        self.bucket = bucket
        with attention_context(self.eager_attention.bind(batch)):
            if first:
                compiled(*self._inputs(bucket))  # trace once, compile the pieces
            self.capturing = True
            try:
                compiled(*self._inputs(bucket))  # each piece warms up and is captured
            finally:
                self.capturing = False
        return compiled

    def _replay(self, bucket: int, captured: Any, batch: ForwardBatch) -> torch.Tensor:
        view = self.buffers.copy_from(batch, bucket, batch.layout.num_requests)
        self.bucket = bucket
        with attention_context(self.eager_attention.bind(view)):
            return captured(*self._inputs(bucket))
