"""The `tc_piecewise` runner: trace once, split at attention, capture pieces per bucket.

Capture: dynamo traces the forward once with a symbolic token count (attention is the opaque
custom op ``capture_service::attention``); the traced graph is split at every attention node;
each non-attention piece is compiled once per distinct structure (inductor on CUDA, the FX graph
as traced on CPU, where inductor's C++ build would dominate a 2-core CI) and captured as its own
graph for every bucket.

Replay: the bucket's tape (``runners/tape.py``), recorded while its pieces were captured: each
piece's graph launch and each attention call, in the split graph's order, over the tensors they
read and write (the same objects at every replay). No dynamo frame, no guard, no FX code and no
per-piece Python run at replay; the attention calls are resolved once per forward by the bound
attention (FlashInfer: its kernel call, recorded), so between two piece launches the host makes
one attention launch, as in ``breakable``. What that removed, per layer: the FX-generated
split code, the piece module's staging checks and graph wrapper, the attention op's context
lookup, output-buffer lookup and the bound attention's per-call bookkeeping.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import fx

from service.model.attention import MLA_NEW, AttentionKey
from service.ranks.attention.custom_op import OpAttention, attention_context
from service.ranks.forward_batch import ForwardBatch
from service.ranks.runners.graph_base import GraphRunner
from service.ranks.runners.graph_capture import CapturedCall
from service.ranks.runners.segment_attention import SegmentAttention
from service.ranks.runners.tape import RecordingAttention, Tape
from service.ranks.runners.tc_piecewise.handover import run_into
from service.ranks.runners.tc_piecewise.pieces import PieceGraph
from service.ranks.runners.tc_piecewise.shared import CaptureState, SharedBuffers
from service.ranks.runners.tc_piecewise.split import (
    call_attention_directly,
    call_modules_directly,
    check_tape_structure,
    is_attention_piece,
    piece_signature,
    shareable_outputs,
    split_at_attention,
)

PIECE_COMPILERS = ("inductor", "dynamo", "eager")


class TcPiecewiseGraphRunner(GraphRunner):
    name = "tc_piecewise"

    def __init__(self, *args: Any, piece_compiler: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if piece_compiler == "auto":
            piece_compiler = "inductor" if self.device.type == "cuda" else "eager"
        if piece_compiler not in PIECE_COMPILERS:
            raise ValueError(
                f"piece_compiler must be one of {PIECE_COMPILERS}, not {piece_compiler}"
            )
        self.piece_compiler = piece_compiler
        kv = self.eager_attention.kv.kv
        # the pieces store K/V themselves: each layer's cache and the static KV slots are inputs
        # read in place (never copied into an input buffer, whatever their first dimension)
        static = [self.buffers.input_ids, self.buffers.positions, self.buffers.out_cache_loc]
        static += [*self.model.parameters(), *self.model.buffers(), *kv]
        registry = self.eager_attention.registry

        def cache_for(key: AttentionKey) -> torch.Tensor | None:
            spec = registry.spec(key)
            return None if spec.kind == MLA_NEW else kv[spec.kv_layer]

        self.op_attention = OpAttention(cache_for, self.buffers.out_cache_loc)
        self.attention = SegmentAttention(self.eager_attention, self.plan.capture_request_capacity)
        self.state = CaptureState(
            buffers=SharedBuffers(self.buffers.max_tokens, self.device, static),
            device=self.device,
            pool=self.pool,
            stream=self.stream,
        )
        self.num_pieces = 0
        self.traces = 0  # dynamo traces of the forward: one unless something recompiles
        self._compiled: Any = None
        self._split: fx.GraphModule | None = None
        self._results: dict[int, torch.Tensor] = {}  # bucket -> the forward's output
        self._pieces: list[PieceGraph] = []
        self._attention_outputs: dict[tuple, torch.Tensor] = {}  # see _attention_output

    @property
    def piece_compiles(self) -> int:
        return self.state.piece_compiles

    @property
    def pieces(self) -> list[PieceGraph]:
        return list(self._pieces)

    def piece_fn(self, sub: fx.GraphModule) -> Any:
        """The callable a piece runs: compiled once per distinct piece structure."""
        if self.piece_compiler == "eager":
            return run_into(sub)
        sig = piece_signature(sub)
        compiled = self.state.compiled
        if sig not in compiled:
            # a code object per structure: dynamo caches per code object, so structures never
            # evict each other past its recompile limit
            base = run_into(sub)
            code = base.__code__.replace(co_name=f"tc_piece_{len(compiled)}")
            fn = types.FunctionType(code, base.__globals__, code.co_name, None, base.__closure__)
            compiled[sig] = torch.compile(
                fn, backend=self._piece_backend, dynamic=True, fullgraph=True
            )
        return compiled[sig]

    def _piece_backend(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.state.piece_compiles += 1
        if self.piece_compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return gm.forward  # "dynamo": traced, not compiled (CPU tests of the sharing)

    def _backend(self):
        def backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]):
            self.traces += 1
            split = split_at_attention(gm)
            check_tape_structure(split)
            shareable = shareable_outputs(split)
            pieces = 0
            for name, sub in list(split.named_children()):
                if is_attention_piece(sub):
                    call_attention_directly(sub)  # attention stays eager, called directly
                    continue
                fn = self.piece_fn(sub)
                piece = PieceGraph(sub, self.state, fn, shareable[name], pieces)
                split.register_module(name, piece)
                self._pieces.append(piece)
                pieces += 1
            self.num_pieces = pieces
            call_modules_directly(split)
            self._split = split

            def run(*args: Any) -> Any:
                out = split(*args)
                if self.state.capturing:  # the tape's result: the last piece's own output
                    self._results[self.state.bucket] = _as_tuple(out)[0]
                return out

            return run

        return backend

    def _forward_code(self):
        model, attention = self.model, self.op_attention

        def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions, attention)

        # a code object of this runner's own: another runner's cache entries never evict it
        code = forward.__code__.replace(co_name=f"tc_piecewise_forward_{id(self):x}")
        fn = types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)
        return torch.compile(fn, backend=self._backend(), dynamic=None, fullgraph=True)

    def _inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos = self.buffers.input_ids[:bucket], self.buffers.positions[:bucket]
        for t in (ids, pos):  # one trace serves every bucket
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return ids, pos

    def captured_calls(self, bucket: int) -> list[CapturedCall]:
        return [piece.captured[bucket][1] for piece in self._pieces]

    def forget(self, num_tokens: int) -> None:
        super().forget(num_tokens)
        self.attention.forget(num_tokens)
        self._results.pop(num_tokens, None)
        for piece in self._pieces:
            piece.captured.pop(num_tokens, None)

    def _capture(self, bucket: int, capture_seq_lens: tuple[int, ...]) -> Any:
        real = tuple(n for n in capture_seq_lens if n > 0)
        self.attention.capture(self.buffers, real, bucket)
        batch = self.buffers.load_synthetic(real, bucket, len(real))
        first = self._compiled is None
        if first:
            self._compiled = self._forward_code()
        self.state.bucket = bucket
        attention = self.eager_attention.bind(batch)
        if first:  # trace once; pieces learn their outputs
            with attention_context(attention, self._attention_output):
                self._compiled(*self._inputs(bucket))
        steps: list[Any] = []
        recorder = RecordingAttention(attention, steps)
        self.state.capturing, self.state.tape = True, steps
        try:  # each piece warms up and is captured; the tape records the replay's order
            with attention_context(recorder, self._attention_output):
                self._compiled(*self._inputs(bucket))
        finally:
            self.state.capturing, self.state.tape = False, None
        if bucket not in self._results:
            raise RuntimeError(f"bucket {bucket} was captured without going through the split")
        recorder.check()
        return Tape(steps, self._results[bucket])

    def _replay(self, bucket: int, captured: Any, batch: ForwardBatch) -> torch.Tensor:
        view = self.attention.load(self.buffers, batch, bucket)
        # the first piece runs before attention is planned (the device works while the host
        # plans), then attention and the pieces in turn
        return captured.run(lambda: self.attention.launches(view, bucket, captured.calls))

    def _attention_output(self, q: torch.Tensor, key: AttentionKey) -> torch.Tensor:
        """Where attention writes: a shared buffer per variant and layer parity, so the next
        piece reads it in place (a static input, never copied) and a layer's output is not
        overwritten before the piece after it has run."""
        sig = (key.layer_id % 2, key.variant, q.shape, q.dtype)
        out = self._attention_outputs.get(sig)
        if out is None:  # made once per shape: this runs between every two pieces
            role = f"attn{key.layer_id % 2}_{key.variant}"
            out = self.state.buffers.get(role, 0, q.shape[0], tuple(q.shape[1:]), q.dtype)
            self._attention_outputs[sig] = out
        return out


def _as_tuple(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)
