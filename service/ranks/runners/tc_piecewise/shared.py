"""State the pieces share: buffers sized once for the largest bucket, and the bucket in hand."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from service.errors import CaptureFailed


class SharedBuffers:
    """Piece inputs and outputs, shared by all pieces and buckets.

    Keyed by (role, position, trailing shape, dtype) and allocated once at the largest bucket, so
    a graph of any bucket reads and writes rows of the same tensors and the graphs hold no
    activations of their own. Never reallocated: captured graphs keep the addresses.
    """

    def __init__(self, max_tokens: int, device: torch.device, static: Iterable[torch.Tensor]):
        self.max_tokens = max_tokens
        self.device = device
        self._buffers: dict[tuple, torch.Tensor] = {}
        # tensors that never move (the runner's static inputs, parameters, buffers): a piece
        # reads them in place instead of copying them into an input buffer
        self._static_ptrs = {t.data_ptr() for t in static}
        self._shared_ptrs: set[int] = set()

    def get(
        self, role: str, index: int, rows: int, trailing: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """The first ``rows`` rows of the buffer of this role, position, shape and dtype."""
        if rows > self.max_tokens:
            raise CaptureFailed(
                f"piece tensor of {rows} rows exceeds the largest bucket {self.max_tokens}"
            )
        key = (role, index, tuple(trailing), dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty((self.max_tokens, *trailing), dtype=dtype, device=self.device)
            self._buffers[key] = buf
            self._static_ptrs.add(buf.data_ptr())
            self._shared_ptrs.add(buf.data_ptr())
        return buf[:rows]

    def is_shared(self, t: torch.Tensor) -> bool:
        return t.data_ptr() in self._shared_ptrs

    def is_static(self, t: torch.Tensor) -> bool:
        return t.data_ptr() in self._static_ptrs


@dataclass
class CaptureState:
    """What every piece reads while the runner captures or replays one bucket."""

    buffers: SharedBuffers
    device: torch.device
    pool: Any
    stream: Any
    bucket: int | None = None  # the bucket being captured or replayed
    capturing: bool = False
    piece_compiles: int = 0  # backend compiles of pieces (one per distinct piece structure)
    compiled: dict[tuple, Any] = field(default_factory=dict)  # piece signature -> callable
    tape: list[Any] | None = None  # while capturing a bucket: its replay steps, in order

    def on_token_axis(self, t: Any) -> bool:
        """A tensor whose rows are the current bucket's tokens."""
        return isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == self.bucket
