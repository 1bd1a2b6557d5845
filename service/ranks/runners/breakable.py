"""`breakable`: captured token-axis segments that break at every attention call.

Per bucket, L+1 segments are captured (embedding + layer 0 up to attention; layer i-1's output
half + layer i's input half; the last output half + final norm). Each segment ends with its
layer's K/V written to the cache, which is token-axis work, so between two segment replays the
host launches one attention kernel with the live batch's metadata and nothing else. One captured
bucket serves any request layout; the output tail (last-token gather, logits) stays eager in the
worker.

Segment inputs and outputs live in buffers allocated once for the largest bucket, and every
segment writes its results where the next consumer reads them: the attention inputs (for Llama
the qkv projection; q, k, v are column slices of it, rotated in place by the fused kernels) go
to one buffer whose column widths the model states (``attention_io``), the fused add-norm
updates the residual buffer in place, attention writes into the attention buffer. Where a
kernel cannot work in place (the torch fallback, MLA's concatenated inputs), the segment copies
its result there; graphs never hold per-bucket activations.

A replay runs the bucket's tape (``tape.py``): the first segment, then the attention plan (while
the device runs that segment), then layer by layer the attention kernel call and the next
segment's graph launch, resolved once per forward, so between two graph launches the host makes
the attention launch and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from service.model.attention import BoundAttention
from service.ranks.forward_batch import ForwardBatch
from service.ranks.runners.graph_base import GraphRunner
from service.ranks.runners.graph_capture import CapturedCall
from service.ranks.runners.segment_attention import SegmentAttention
from service.ranks.runners.state_buffers import StateBuffers, place
from service.ranks.runners.tape import Tape


@dataclass(frozen=True)
class SegmentBuffers:
    state: StateBuffers  # the residual and the attention inputs, between segments
    attn: torch.Tensor  # (Tmax, out width) attention output, written eagerly between segments
    hidden: torch.Tensor  # (Tmax, H) final hidden states


class BreakableGraphRunner(GraphRunner):
    name = "breakable"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _, out_width = self.model.attention_io()
        t, h = self.buffers.max_tokens, self.model.cfg.hidden_size
        dtype = self.model.embed_tokens.weight.dtype

        def z(width: int) -> torch.Tensor:
            return torch.zeros(t, width, dtype=dtype, device=self.device)

        state = StateBuffers.allocate(self.model, t, self.device)
        self.seg = SegmentBuffers(state=state, attn=z(out_width), hidden=z(h))
        self.attention = SegmentAttention(self.eager_attention, self.plan.capture_request_capacity)

    def _segment_fns(self, bucket: int, attention: BoundAttention) -> list:
        s, m = self.seg, self.model
        ids, positions = self.buffers.input_ids[:bucket], self.buffers.positions[:bucket]
        residual, qkv, attn_out = s.state.residual[:bucket], s.state.qkv[:bucket], s.attn[:bucket]

        def keep(outs: tuple[torch.Tensor, ...]) -> None:  # the residual, the attention inputs
            s.state.keep(bucket, outs)

        def first() -> None:
            keep(m.first_segment(ids, positions, attention, qkv_out=qkv))

        def middle(i: int):
            def run() -> None:
                keep(m.middle_segment(i, residual, attn_out, positions, attention, qkv_out=qkv))

            return run

        def last() -> None:
            place(s.hidden[:bucket], m.last_segment(residual, attn_out))

        return [first, *(middle(i) for i in range(1, len(m.layers))), last]

    def _attend(
        self, i: int, attention: BoundAttention, views: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> None:
        """Layer i's attention from the segment buffer's ``views`` into ``out`` (both made
        once per forward: the same buffers serve every layer)."""
        place(out, self.model.attend(i, views, attention, out))

    def _capture(self, bucket: int, capture_seq_lens: tuple[int, ...]) -> Any:
        real = tuple(n for n in capture_seq_lens if n > 0)
        self.attention.capture(self.buffers, real, bucket)
        batch = self.buffers.load_synthetic(real, bucket, len(real))
        attention = self.eager_attention.bind(batch)
        # the segments store K/V through the static buffers' out_cache_loc, so the captured
        # stores write where each replay's live tokens go
        fns = self._segment_fns(bucket, attention)
        views, out = self.seg.state.qkv_views(bucket), self.seg.attn[:bucket]
        captured = []
        for i, fn in enumerate(fns):
            if i > 0:  # attention of layer i-1 on the synthetic batch feeds segment i
                self._attend(i - 1, attention, views, out)
            captured.append(CapturedCall(fn, self.device, self.pool, self.stream))
        return Segments(captured, self._tape(bucket, captured, views, out))

    def _tape(
        self,
        bucket: int,
        captured: list[CapturedCall],
        views: tuple[torch.Tensor, ...],
        out: torch.Tensor,
    ) -> Tape:
        """The forward, flat: the first segment, then layer i's attention calls (the views and
        output made once for the bucket) and segment i+1."""
        steps: list[Any] = [captured[0]]
        for i, call in enumerate(captured[1:]):
            steps.extend(self.model.attend_calls(i, views, out))
            steps.append(call)
        return Tape(steps, self.seg.hidden[:bucket])

    def captured_calls(self, bucket: int) -> list[CapturedCall]:
        return list(self._captured[bucket].calls)

    def _replay(self, bucket: int, captured: Any, batch: ForwardBatch) -> torch.Tensor:
        view = self.attention.load(self.buffers, batch, bucket)
        tape = captured.tape
        # the first segment (embedding up to layer 0's attention inputs) needs no attention
        # plan: the tape launches it first, then plans once for the forward; then each layer:
        # attention, the next segment
        return tape.run(lambda: self.attention.launches(view, bucket, tape.calls))

    def forget(self, num_tokens: int) -> None:
        super().forget(num_tokens)
        self.attention.forget(num_tokens)


@dataclass(frozen=True)
class Segments:
    """A bucket's captured segments and the tape that replays them."""

    calls: list[CapturedCall]
    tape: Tape
