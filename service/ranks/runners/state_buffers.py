"""Where a forward's state waits between two captured graphs: the residual stream and the next
layer's attention inputs, in buffers allocated once for the largest bucket.

A runner that captures a forward in pieces (``breakable``'s segments, ``full``'s chain) has each
piece leave the state here and the next read it from here, so no graph holds per-bucket state
and every bucket and graph variant shares the same two buffers (only one replays at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.model.llama import CausalLM


def place(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` holds ``src`` afterwards: nothing to do when a kernel already wrote it there."""
    if src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride():
        dst.copy_(src)


@dataclass(frozen=True)
class StateBuffers:
    residual: torch.Tensor  # (Tmax, H) the residual stream
    qkv: torch.Tensor  # (Tmax, sum of widths) attention inputs (Llama: the qkv projection)
    widths: tuple[int, ...]  # column widths of the attention inputs (``attention_io``)

    @staticmethod
    def allocate(model: CausalLM, max_tokens: int, device: torch.device) -> StateBuffers:
        widths, _ = model.attention_io()
        dtype = model.embed_tokens.weight.dtype

        def z(width: int) -> torch.Tensor:
            return torch.zeros(max_tokens, width, dtype=dtype, device=device)

        return StateBuffers(z(model.cfg.hidden_size), z(sum(widths)), tuple(widths))

    def qkv_views(self, rows: int) -> tuple[torch.Tensor, ...]:
        return tuple(self.qkv[:rows].split(list(self.widths), dim=-1))

    def state(self, rows: int) -> tuple[torch.Tensor, ...]:
        """(residual, *attention inputs) over the first ``rows`` tokens, as the model's
        segments return them."""
        return (self.residual[:rows], *self.qkv_views(rows))

    def keep(self, rows: int, state: tuple[torch.Tensor, ...]) -> None:
        """Leave ``state`` (a segment's result) here, copying only what is not already here."""
        for dst, src in zip(self.state(rows), state, strict=True):
            place(dst, src)
