"""`tc_piecewise`: torch.compile splits the forward at attention; pieces are captured per bucket.

Dynamo traces the forward once with a symbolic token count; attention is the opaque custom op
``capture_service::attention``. The traced FX graph is split at every attention node
(``torch.fx.passes.split_module``); each non-attention piece is compiled once for dynamic shapes
(inductor on CUDA by default, the FX graph as traced on CPU, where inductor's C++ build would
dominate a 2-core CI) and captured as its own graph for every bucket. Attention runs eagerly
between pieces with the live batch.

One trace serves every bucket: nothing in the traced forward tests the token count (the MLP's
eager token chunking is skipped under compile). ``traces`` counts dynamo traces, so a test sees
a retrace at once instead of a silent recompile.
"""

from __future__ import annotations

import operator
import types
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

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


def run_into(sub: fx.GraphModule):
    """``sub``, writing its buffered outputs into the given ``outs`` (None: returned as is)."""

    def run(outs: list[torch.Tensor | None], *args: Any) -> Any:
        res = sub(*args)
        flat = res if isinstance(res, (tuple, list)) else (res,)
        for o, r in zip(outs, flat, strict=False):
            if o is not None:
                o.copy_(r)
        return tuple(o if o is not None else r for o, r in zip(outs, flat, strict=False))

    return run


def piece_signature(sub: fx.GraphModule) -> tuple:
    """The piece's graph up to placeholder names. Parameters are graph inputs (dynamo lifts
    them), so pieces of equal signature (the middle layers) compute the same function of their
    arguments and can share one compiled callable."""
    index: dict[fx.Node, int] = {}
    sig = []
    for i, node in enumerate(sub.graph.nodes):
        index[node] = i
        if node.op in ("get_attr", "call_module"):  # state of its own: never shared
            return ("unshared", id(sub))
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: ("node", index[a]))
        target = "" if node.op == "placeholder" else str(node.target)
        sig.append((node.op, target, repr(args)))
    return tuple(sig)


class PieceGraph(nn.Module):
    """One compiled piece, captured as one graph per bucket while the runner captures.

    Memory: a piece's inputs and outputs live in buffers shared by all pieces and buckets
    (sized for the largest bucket, keyed by position, trailing shape and dtype), never in the
    graph itself. Inputs that already are such buffers (the previous piece's outputs, the
    runner's static inputs) are used in place; others (attention outputs) are copied into an
    input buffer. The piece writes its outputs into the output buffers from inside the compiled
    code, so inductor's last kernel stores straight there (no copy after the graph); neighbours
    alternate between two sets of output buffers, so a piece never writes what it reads. An
    output that something later than the next piece still needs (``shareable`` False) stays
    owned by the graph.
    """

    def __init__(
        self, sub: fx.GraphModule, runner: TcPiecewiseGraphRunner, shareable: list[bool], idx: int
    ) -> None:
        super().__init__()
        self.sub = sub
        self.runner = runner
        self.shareable = shareable
        self.parity = idx % 2
        self.fn: Any = runner.piece_fn(sub)
        self.out_specs: list[tuple[tuple[int, ...], torch.dtype] | None] | None = None
        self.tuple_out = True
        self.captured: dict[int, tuple[list[Any], CapturedCall]] = {}  # bucket -> inputs, graph

    def _learn_outputs(self, args: tuple) -> Any:
        """The first run after the trace: plain FX, to learn which outputs go to buffers."""
        res = self.sub(*args)
        self.tuple_out = isinstance(res, (tuple, list))
        flat = res if self.tuple_out else (res,)
        specs = []
        for i, r in enumerate(flat):
            share = i < len(self.shareable) and self.shareable[i]
            # token-axis outputs only: the buffers are sliced to each bucket's rows
            ok = share and self.runner.on_token_axis(r)
            specs.append((tuple(r.shape[1:]), r.dtype) if ok else None)
        self.out_specs = specs
        return res

    def _outs(self, rows: int) -> list[torch.Tensor | None]:
        assert self.out_specs is not None
        return [
            None if spec is None
            else self.runner.shared(f"out{self.parity}", i, rows, spec[0], spec[1])
            for i, spec in enumerate(self.out_specs)
        ]  # fmt: skip

    def _call(self, outs: list[torch.Tensor | None], args: list[Any]) -> Any:
        for t in (*outs, *args):  # the token axis is symbolic: one compile for every bucket
            # only the shared buffers: the forward's own inputs are marked in _inputs, and a
            # mark on a parameter (whose first dim may equal a bucket) would retrace the forward
            if self.runner.on_token_axis(t) and self.runner.is_shared(t):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        res = self.fn(outs, *args)
        return tuple(res) if self.tuple_out else res[0]

    def _stage(self, args: tuple) -> list[Any]:
        staged = []
        for i, a in enumerate(args):
            # non-token tensors (a float attribute dynamo lifted to a 0-d tensor) are constants
            if not self.runner.on_token_axis(a) or self.runner.is_static(a):
                staged.append(a)
            else:
                staged.append(
                    self.runner.shared("in", i, a.shape[0], a.shape[1:], a.dtype).copy_(a)
                )
        return staged

    def forward(self, *args: Any) -> Any:
        bucket = self.runner.bucket
        entry = self.captured.get(bucket)
        if entry is None:
            if self.out_specs is None:
                return self._learn_outputs(args)
            outs = self._outs(bucket)
            if not self.runner.capturing:
                return self._call(outs, list(args))
            static = self._stage(args)
            call = CapturedCall(lambda: self._call(outs, static), self.runner.device,
                                self.runner.pool, self.runner.stream)  # fmt: skip
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
        if piece_compiler not in ("inductor", "dynamo", "eager"):
            raise ValueError(
                f"piece_compiler must be inductor, dynamo or eager, not {piece_compiler}"
            )
        self.piece_compiler = piece_compiler
        self.piece_compiles = 0  # backend compiles of pieces (one per distinct piece structure)
        self._piece_fns: dict[tuple, Any] = {}
        self.capturing = False
        self.bucket: int | None = None  # the bucket being captured or replayed
        self.num_pieces = 0
        self.traces = 0  # dynamo traces of the forward: one unless something recompiles
        self._compiled: Any = None
        self._pieces: list[PieceGraph] = []
        self._shared: dict[tuple, torch.Tensor] = {}
        # Dynamo lifts parameters and buffers into graph inputs: they are static, never copied
        self._static_ptrs = {self.buffers.input_ids.data_ptr(), self.buffers.positions.data_ptr()}
        self._static_ptrs |= {t.data_ptr() for t in self.model.parameters()}
        self._static_ptrs |= {t.data_ptr() for t in self.model.buffers()}
        self._shared_ptrs: set[int] = set()

    def shared(
        self, role: str, index: int, rows: int, trailing: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """The first ``rows`` rows of a buffer shared by every piece and bucket."""
        key = (role, index, tuple(trailing), dtype)
        buf = self._shared.get(key)
        if rows > self.buffers.max_tokens:
            raise CaptureFailed(
                f"piece tensor of {rows} rows exceeds the largest bucket {self.buffers.max_tokens}"
            )
        if buf is None:  # never reallocated: captured graphs keep the address
            shape = (self.buffers.max_tokens, *trailing)
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self._shared[key] = buf
            self._static_ptrs.add(buf.data_ptr())
            self._shared_ptrs.add(buf.data_ptr())
        return buf[:rows]

    def piece_fn(self, sub: fx.GraphModule) -> Any:
        """The callable a piece runs: compiled once per distinct piece structure."""
        if self.piece_compiler == "eager":
            return run_into(sub)
        sig = piece_signature(sub)
        if sig not in self._piece_fns:
            # a code object per structure: dynamo caches per code object, so structures never
            # evict each other past its recompile limit
            base = run_into(sub)
            code = base.__code__.replace(co_name=f"tc_piece_{len(self._piece_fns)}")
            fn = types.FunctionType(code, base.__globals__, code.co_name, None, base.__closure__)
            self._piece_fns[sig] = torch.compile(
                fn, backend=self._piece_backend, dynamic=True, fullgraph=True
            )
        return self._piece_fns[sig]

    def _piece_backend(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.piece_compiles += 1
        if self.piece_compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return gm.forward  # "dynamo": traced, not compiled (CPU tests of the sharing)

    def on_token_axis(self, t: Any) -> bool:
        """A tensor whose rows are the current bucket's tokens."""
        return isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == self.bucket

    def is_shared(self, t: torch.Tensor) -> bool:
        return t.data_ptr() in self._shared_ptrs

    def is_static(self, t: torch.Tensor) -> bool:
        return t.data_ptr() in self._static_ptrs

    def _backend(self):
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
                piece = PieceGraph(sub, self, shareable[name], pieces)
                split.register_module(name, piece)
                self._pieces.append(piece)
                pieces += 1
            self.num_pieces = pieces
            return split.forward

        return backend

    def _forward_code(self):
        model = self.model

        def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions, op_attend)

        # a code object of this runner's own: another runner's cache entries never evict it
        code = forward.__code__.replace(co_name=f"tc_piecewise_forward_{id(self):x}")
        fn = types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)
        return torch.compile(fn, backend=self._backend(), dynamic=None, fullgraph=True)

    def _inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos = self.buffers.input_ids[:bucket], self.buffers.positions[:bucket]
        for t in (ids, pos):  # one trace serves every bucket
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return ids, pos

    def forget(self, num_tokens: int) -> None:
        super().forget(num_tokens)
        for piece in self._pieces:
            piece.captured.pop(num_tokens, None)

    def _capture(self, bucket: int, capture_seq_lens: tuple[int, ...]) -> Any:
        real = tuple(n for n in capture_seq_lens if n > 0)
        batch = self.buffers.load_synthetic(real, bucket, len(real))
        first = self._compiled is None
        if first:
            self._compiled = self._forward_code()
        compiled = self._compiled
        self.bucket = bucket
        with attention_context(self.eager_attention.bind(batch)):
            if first:
                compiled(*self._inputs(bucket))  # trace once; pieces learn their outputs
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
