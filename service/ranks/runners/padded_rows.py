"""The token or slot rows of a static buffer past each live batch, kept holding the pad.

Why: a replay copies its live batch into the first rows of its bucket (or decode size), and the
rows past it must hold the pad (service.padding). Padding them at every replay was one more
device op and launch before the graph; only rows an earlier batch or a capture wrote need it
(:func:`service.padding.rows_to_pad`, the rule), so a batch at least as long as every one since
the rows were last padded makes one copy. The prefill and decode buffers each keep one.
"""

from __future__ import annotations

import torch

from service.padding import rows_to_pad


class PaddedRows:
    """``rows`` (R, N): every column the pad (R, 1) until a batch or a capture writes it."""

    def __init__(self, pad: torch.Tensor, width: int) -> None:
        self.pad = pad
        self.rows = pad.expand(-1, width).contiguous()
        self.pad_from = 0  # every column from here on holds the pad

    def write(self, live: torch.Tensor, width: int) -> None:
        """Columns ``:B`` written with ``live`` (R, B) in one copy, then columns ``B:width``
        padded where they need it."""
        b = live.shape[1]
        self.rows[:, :b].copy_(live)
        self.pad_after(b, width)

    def pad_after(self, live: int, width: int) -> None:
        """Columns ``live:width`` padded, columns ``:live`` just written with a live batch."""
        start, end, self.pad_from = rows_to_pad(live, width, self.pad_from)
        if end > start:
            self.rows[:, start:end].copy_(self.pad.expand(-1, end - start))

    def dirtied(self, width: int) -> None:
        """Columns ``:width`` written with something other than the pad (a capture's)."""
        self.pad_from = max(self.pad_from, width)
