"""Decode graphs: the whole decode step (forward and logits) captured once per decode batch size.

A decode batch of B requests replays the graph of the smallest captured size S >= B through
static buffers: the live requests fill the first B slots, the S - B padded slots follow the
padding rule (service.padding): token 0 at position 0, K/V to the padding slot, the sentinel row,
one KV entry; their logits rows are dropped. Attention is graph-safe: FlashInfer's decode
wrapper in CUDA-graph mode (planned on the host before every replay) or the batched torch decode
attention (lengths read from device tensors). On CPU the same path runs through recorded graphs
(service.ranks.runners.graph_capture), reported as ``cpu``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from service.capture_result import CaptureStat
from service.commands import GraphKind
from service.decode_sizes import DecodeDecision, DecodePlan
from service.errors import CaptureFailed
from service.model.llama import CausalLM
from service.padding import PADDING_POSITION, PADDING_SLOT, PADDING_TOKEN_ID, SENTINEL_ROW
from service.ranks.attention.base import AttentionBackend
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.ranks.runners.graph_capture import CapturedCall, timed_capture
from service.ranks.runners.padded_rows import PaddedRows


@dataclass(frozen=True)
class DecodeStaticBuffers:
    """The inputs every decode graph reads, sized once for the largest size."""

    input_ids: torch.Tensor  # (Smax,) row 0 of ``padding.rows``
    positions: torch.Tensor  # (Smax,) row 1 = prefix_lens: the new token's position
    out_cache_loc: torch.Tensor  # (Smax,) row 2
    req_pool_indices: torch.Tensor  # (Smax,) row 3
    extend_lens: torch.Tensor  # (Smax,) ones
    extend_start_loc: torch.Tensor  # (Smax,) 0 .. Smax-1
    # the four rows above as one (4, Smax) tensor, kept holding the pad (token id, position,
    # KV slot, row) past each live batch: a built decode batch's ids, positions, KV slots and
    # request rows are the first 4B entries of its packed tensor, in that order, so one copy
    # takes them in (four copies and four fills before every replay cost the host ~19 us on
    # the dev CPU: benchmarks/host_costs.py load)
    padding: PaddedRows = field(compare=False, repr=False)
    # size -> the view's seven slices, made once: slicing costs host time before every replay
    _slices: dict[int, tuple[torch.Tensor, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @staticmethod
    def allocate(max_size: int, device: torch.device) -> DecodeStaticBuffers:
        pad = torch.tensor(
            [[PADDING_TOKEN_ID], [PADDING_POSITION], [PADDING_SLOT], [SENTINEL_ROW]],
            dtype=torch.int64, device=device,
        )  # fmt: skip
        padding = PaddedRows(pad, max_size)
        return DecodeStaticBuffers(
            *padding.rows.unbind(0),
            extend_lens=torch.ones(max_size, dtype=torch.int64, device=device),
            extend_start_loc=torch.arange(max_size, dtype=torch.int64, device=device),
            padding=padding,
        )  # fmt: skip

    def view(self, layout: BatchLayout, size: int) -> ForwardBatch:
        got = self._slices.get(size)
        if got is None:
            got = self._slices[size] = (
                self.input_ids[:size], self.positions[:size], self.out_cache_loc[:size],
                self.req_pool_indices[:size],
                self.positions[:size],  # prefix_lens: a decode token sits right after its prefix
                self.extend_lens[:size], self.extend_start_loc[:size],
            )  # fmt: skip
        return ForwardBatch(layout, *got)

    def copy_from(self, batch: ForwardBatch, size: int) -> ForwardBatch:
        """The live decode batch in the first B slots, padded slots after it, up to ``size``:
        one copy, and one more only where a slot past B holds something other than the pad."""
        b = batch.layout.num_requests
        if b > size or size > self.input_ids.shape[0]:
            raise ValueError(f"decode batch of {b} does not fit size {size}")
        packed = batch.packed
        if batch.layout.num_tokens != b or packed is None or packed.numel() != 7 * b:
            raise ValueError(
                "a replayed decode batch must be one built by ForwardBatch.build (packed), one "
                "token per request"
            )
        self.padding.write(packed[: 4 * b].view(4, b), size)  # ids, positions, slots, rows
        return self.view(batch.layout, size)

    def load_synthetic(self, size: int) -> ForwardBatch:
        """The capture batch: ``size`` one-token requests in distinct rows, writing the padding
        slot, so capture never touches live KV."""
        # capture rows are distinct (req_pool_indices 0..size-1), not the sentinel row: the next
        # live batch pads over them
        self.padding.dirtied(size)
        self.input_ids[:size].fill_(PADDING_TOKEN_ID)
        self.positions[:size].fill_(PADDING_POSITION)
        self.out_cache_loc[:size].fill_(PADDING_SLOT)
        self.req_pool_indices[:size].copy_(torch.arange(size))
        layout = BatchLayout(ForwardMode.DECODE, tuple(range(size)), (0,) * size, (1,) * size)
        return self.view(layout, size)


class DecodeGraphRunner:
    def __init__(
        self,
        plan: DecodePlan,
        model: CausalLM,
        attention: AttentionBackend,
        device: torch.device,
    ) -> None:
        if not attention.graph_safe:
            raise ValueError(f"attention backend {attention.name} is not graph-safe")
        self.plan = plan
        self.model = model
        self.attention = attention
        self.device = device
        self.buffers = DecodeStaticBuffers.allocate(max(plan.sizes), device)
        # a pool of its own: decode graphs never share memory with the prefill graphs
        self.pool: Any = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._captured: dict[int, CapturedCall] = {}

    @property
    def graph_kind(self) -> GraphKind:
        return "cuda" if self.device.type == "cuda" else "cpu"

    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured))

    def captured_calls(self, size: int) -> list[CapturedCall]:
        return [self._captured[size]]

    def can_replay(self, decision: DecodeDecision) -> bool:
        return decision.hit and decision.size in self._captured

    def capture(self, size: int) -> CaptureStat:
        if size not in self.plan.sizes:
            raise CaptureFailed(f"decode size {size} is not in the agreed plan")

        def capture() -> CapturedCall:
            batch = self.buffers.load_synthetic(size)
            self.attention.prepare(batch, size)

            def step() -> torch.Tensor:  # -> logits (S, V) float32
                hidden = self.model(batch.input_ids, batch.positions, self.attention.bind(batch))
                return self.model.logits(hidden)

            return CapturedCall(step, self.device, self.pool, self.stream)

        self._captured[size], stat = timed_capture(size, self.device, capture)
        return stat

    def forget(self, size: int) -> None:
        self._captured.pop(size, None)
        self.attention.forget(size)

    def run(self, batch: ForwardBatch, decision: DecodeDecision) -> torch.Tensor:
        """Logits (B, V) of a live decode batch of B requests."""
        size = decision.size
        if size not in self._captured:
            raise CaptureFailed(f"decode size {size} was not captured")
        view = self.buffers.copy_from(batch, size)
        self.attention.prepare(view, size)
        return self._captured[size].replay()[: batch.layout.num_requests]
