"""One compiled piece of the split forward, captured as one graph per bucket."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from service.ranks.runners.graph_capture import CapturedCall
from service.ranks.runners.tc_piecewise.shared import CaptureState


class PieceGraph(nn.Module):
    """One compiled piece, captured as one graph per bucket while the runner captures.

    Memory: a piece's inputs and outputs live in buffers shared by all pieces and buckets
    (:class:`~service.ranks.runners.tc_piecewise.shared.SharedBuffers`), never in the graph
    itself. Inputs that already are such buffers (the previous piece's outputs, the runner's
    static inputs) are used in place; others (attention outputs) are copied into an input buffer.
    The piece writes its outputs into the output buffers from inside the compiled code, so
    inductor's last kernel stores straight there (no copy after the graph); neighbours alternate
    between two sets of output buffers, so a piece never writes what it reads. An output that
    something later than the next piece still needs (``shareable`` False) stays owned by the
    graph.
    """

    def __init__(
        self, sub: fx.GraphModule, state: CaptureState, fn: Any, shareable: list[bool], idx: int
    ) -> None:
        super().__init__()
        self.sub = sub
        self.state = state
        self.fn = fn
        self.shareable = shareable
        self.parity = idx % 2
        self.out_specs: list[tuple[tuple[int, ...], torch.dtype] | None] | None = None
        self.tuple_out = True
        # bucket -> (inputs, graph)
        self.captured: dict[int, tuple[list[Any], CapturedCall]] = {}

    def _learn_outputs(self, args: tuple) -> Any:
        """The first run after the trace: plain FX, to learn which outputs go to buffers."""
        res = self.sub(*args)
        self.tuple_out = isinstance(res, (tuple, list))
        flat = res if self.tuple_out else (res,)
        specs = []
        for i, r in enumerate(flat):
            share = i < len(self.shareable) and self.shareable[i]
            # token-axis outputs only: the buffers are sliced to each bucket's rows
            ok = share and self.state.on_token_axis(r)
            specs.append((tuple(r.shape[1:]), r.dtype) if ok else None)
        self.out_specs = specs
        return res

    def _outs(self, rows: int) -> list[torch.Tensor | None]:
        if self.out_specs is None:
            raise RuntimeError("a piece ran before it learned its outputs")
        buffers = self.state.buffers
        return [
            None if spec is None
            else buffers.get(f"out{self.parity}", i, rows, spec[0], spec[1])
            for i, spec in enumerate(self.out_specs)
        ]  # fmt: skip

    def _call(self, outs: list[torch.Tensor | None], args: list[Any]) -> Any:
        for t in (*outs, *args):  # the token axis is symbolic: one compile for every bucket
            # only the shared buffers: the forward's own inputs are marked by the runner, and a
            # mark on a parameter (whose first dim may equal a bucket) would retrace the forward
            if self.state.on_token_axis(t) and self.state.buffers.is_shared(t):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        res = self.fn(outs, *args)
        return tuple(res) if self.tuple_out else res[0]

    def _stage(self, args: tuple) -> list[Any]:
        staged = []
        buffers = self.state.buffers
        for i, a in enumerate(args):
            # non-token tensors (a float attribute dynamo lifted to a 0-d tensor) are constants
            if not self.state.on_token_axis(a) or buffers.is_static(a):
                staged.append(a)
            else:
                staged.append(buffers.get("in", i, a.shape[0], a.shape[1:], a.dtype).copy_(a))
        return staged

    def forward(self, *args: Any) -> Any:
        state = self.state
        if state.bucket in self.captured:
            raise RuntimeError(
                f"a piece ran again for captured bucket {state.bucket}: replays go through the "
                "bucket's tape, not through the split graph"
            )
        if self.out_specs is None:
            return self._learn_outputs(args)
        outs = self._outs(state.bucket)
        if not state.capturing:
            return self._call(outs, list(args))
        if state.tape is None:
            raise RuntimeError("pieces are captured into a bucket's tape; none was started")
        static = self._stage(args)
        call = CapturedCall(lambda: self._call(outs, static), state.device,
                            state.pool, state.stream)  # fmt: skip
        self.captured[state.bucket] = (static, call)
        # the bucket's replay: copy the inputs staged at capture (arguments that are not shared
        # buffers, static inputs or parameters, which the graph reads in place), then replay
        state.tape.extend(_copy(s, a) for a, s in zip(args, static, strict=True) if a is not s)
        state.tape.append(call)
        return call.out


def _copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], Any]:
    def copy() -> None:
        dst.copy_(src)

    return copy
