"""`breakable`: captured token-axis segments that break at every attention call.

Per bucket, L+1 segments are captured (embedding + layer 0 up to attention; layer i-1's output
half + layer i's input half; the last output half + final norm). Between segment replays,
attention runs eagerly with the live batch's metadata, so one captured bucket serves any request
layout; the output tail (last-token gather, logits) stays eager in the worker.

Segment inputs and outputs are slices of buffers allocated once for the largest bucket; every
segment writes its results there, so graphs never hold per-bucket activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from service.model.attention import AttentionFn
from service.ranks.forward_batch import ForwardBatch
from service.ranks.runners.graph_base import GraphRunner
from service.ranks.runners.graph_capture import CapturedCall


@dataclass(frozen=True)
class SegmentBuffers:
    x: torch.Tensor  # (Tmax, H) residual stream
    q: torch.Tensor  # (Tmax, Hq*D)
    k: torch.Tensor  # (Tmax, Hkv*D)
    v: torch.Tensor  # (Tmax, Hkv*D)
    attn: torch.Tensor  # (Tmax, Hq*D) attention output, written eagerly between segments
    hidden: torch.Tensor  # (Tmax, H) final hidden states


class BreakableGraphRunner(GraphRunner):
    name = "breakable"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        attn = self.model.layers[0].self_attn
        t, h = self.buffers.max_tokens, self.model.cfg.hidden_size
        dtype = self.model.embed_tokens.weight.dtype

        def z(width: int) -> torch.Tensor:
            return torch.zeros(t, width, dtype=dtype, device=self.device)

        self.seg = SegmentBuffers(
            x=z(h), q=z(attn.q_size), k=z(attn.kv_size), v=z(attn.kv_size),
            attn=z(attn.q_size), hidden=z(h),
        )  # fmt: skip

    def _segment_fns(self, bucket: int, positions: torch.Tensor) -> list:
        s, m = self.seg, self.model

        def store(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            s.x[:bucket].copy_(x)
            s.q[:bucket].copy_(q)
            s.k[:bucket].copy_(k)
            s.v[:bucket].copy_(v)

        def first() -> None:
            store(*m.first_segment(self.buffers.input_ids[:bucket], positions))

        def middle(i: int):
            def run() -> None:
                store(*m.middle_segment(i, s.x[:bucket], s.attn[:bucket], positions))

            return run

        def last() -> None:
            s.hidden[:bucket].copy_(m.last_segment(s.x[:bucket], s.attn[:bucket]))

        return [first, *(middle(i) for i in range(1, len(m.layers))), last]

    def _attend(self, i: int, bucket: int, attend: AttentionFn) -> None:
        s = self.seg
        key = self.model.layers[i].self_attn.key
        s.attn[:bucket].copy_(attend(s.q[:bucket], s.k[:bucket], s.v[:bucket], key))

    def _capture(self, bucket: int, capture_seq_lens: tuple[int, ...]) -> Any:
        real = tuple(n for n in capture_seq_lens if n > 0)
        batch = self.buffers.load_synthetic(real, bucket, len(real))
        fns = self._segment_fns(bucket, self.buffers.positions[:bucket])
        attend = self.eager_attention.bind(batch)
        captured = []
        for i, fn in enumerate(fns):
            if i > 0:  # attention of layer i-1 on the synthetic batch feeds segment i
                self._attend(i - 1, bucket, attend)
            captured.append(CapturedCall(fn, self.device, self.pool, self.stream))
        return captured

    def captured_calls(self, bucket: int) -> list[CapturedCall]:
        return list(self._captured[bucket])

    def _replay(self, bucket: int, captured: Any, batch: ForwardBatch) -> torch.Tensor:
        view = self.buffers.copy_from(batch, bucket, batch.layout.num_requests)
        attend = self.eager_attention.bind(view)  # one plan per replay, not one per layer
        captured[0].replay()
        for i in range(1, len(captured)):
            self._attend(i - 1, bucket, attend)
            captured[i].replay()
        return self.seg.hidden[:bucket]
