"""Typed static input buffers of prefill capture and replay, sized once for the largest bucket.

Every captured graph reads its inputs from slices of these tensors, so replay only copies a
real batch in (:meth:`PrefillStaticBuffers.copy_from`) and never re-records addresses.

Padding invariant (written here because this is where padding happens): tokens past the real
ones get ``input_ids = 0``, ``positions = 0`` and ``out_cache_loc = PADDING_SLOT``, so their K/V
writes land in the reserved slot and never in a live request's KV entries; request slots past
the real requests are zero-length sentinels (row 0, prefix 0, extend 0, start at the end of the
real tokens), which attention must treat as empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.padding import PADDING_SLOT
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode


@dataclass(frozen=True)
class PrefillStaticBuffers:
    input_ids: torch.Tensor  # (Tmax,)
    positions: torch.Tensor  # (Tmax,)
    out_cache_loc: torch.Tensor  # (Tmax,)
    req_pool_indices: torch.Tensor  # (Cmax,)
    prefix_lens: torch.Tensor  # (Cmax,)
    extend_lens: torch.Tensor  # (Cmax,)
    extend_start_loc: torch.Tensor  # (Cmax,)

    @staticmethod
    def allocate(max_tokens: int, max_requests: int, device: torch.device) -> PrefillStaticBuffers:
        def z(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        return PrefillStaticBuffers(
            input_ids=z(max_tokens),
            positions=z(max_tokens),
            out_cache_loc=z(max_tokens),
            req_pool_indices=z(max_requests),
            prefix_lens=z(max_requests),
            extend_lens=z(max_requests),
            extend_start_loc=z(max_requests),
        )

    @property
    def max_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_requests(self) -> int:
        return self.req_pool_indices.shape[0]

    def view(self, layout: BatchLayout, num_tokens: int, num_slots: int) -> ForwardBatch:
        """A batch over the first ``num_tokens`` tokens and ``num_slots`` request slots."""
        return ForwardBatch(
            layout=layout,
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            out_cache_loc=self.out_cache_loc[:num_tokens],
            req_pool_indices=self.req_pool_indices[:num_slots],
            prefix_lens=self.prefix_lens[:num_slots],
            extend_lens=self.extend_lens[:num_slots],
            extend_start_loc=self.extend_start_loc[:num_slots],
        )

    def copy_from(self, batch: ForwardBatch, bucket: int, num_slots: int) -> ForwardBatch:
        """Copy a real batch in, pad tokens to ``bucket`` and requests to ``num_slots``."""
        n, b = batch.num_tokens, batch.layout.num_requests
        if n > bucket or bucket > self.max_tokens or b > num_slots or num_slots > self.max_requests:
            raise ValueError(
                f"batch of {n} tokens / {b} requests does not fit bucket {bucket} / "
                f"{num_slots} slots (buffers {self.max_tokens} / {self.max_requests})"
            )
        self.input_ids[:n].copy_(batch.input_ids)
        self.input_ids[n:bucket].zero_()
        self.positions[:n].copy_(batch.positions)
        self.positions[n:bucket].zero_()
        self.out_cache_loc[:n].copy_(batch.out_cache_loc)
        self.out_cache_loc[n:bucket].fill_(PADDING_SLOT)
        self.req_pool_indices[:b].copy_(batch.req_pool_indices)
        self.prefix_lens[:b].copy_(batch.prefix_lens)
        self.extend_lens[:b].copy_(batch.extend_lens)
        self.extend_start_loc[:b].copy_(batch.extend_start_loc)
        self._sentinels(b, num_slots, n)
        return self.view(batch.layout, bucket, num_slots)

    def load_synthetic(
        self, capture_seq_lens: tuple[int, ...], bucket: int, num_slots: int
    ) -> ForwardBatch:
        """The capture batch of a bucket: one synthetic request per non-zero length, each in
        its own request-pool row and within ``context_length``; zero lengths are sentinels.

        Every synthetic token writes the padding slot, so capture never touches live KV.
        """
        real = [n for n in capture_seq_lens if n > 0]
        if sum(real) != bucket or len(capture_seq_lens) > num_slots:
            raise ValueError(f"capture lengths {capture_seq_lens} do not make bucket {bucket}")
        positions: list[int] = []
        starts: list[int] = []
        for n in real:
            starts.append(len(positions))
            positions.extend(range(n))
        k = len(real)
        self.input_ids[:bucket].zero_()
        self.positions[:bucket].copy_(torch.tensor(positions, dtype=torch.int64))
        self.out_cache_loc[:bucket].fill_(PADDING_SLOT)
        self.req_pool_indices[:k].copy_(torch.arange(k))  # distinct rows
        self.prefix_lens[:k].zero_()
        self.extend_lens[:k].copy_(torch.tensor(real, dtype=torch.int64))
        self.extend_start_loc[:k].copy_(torch.tensor(starts, dtype=torch.int64))
        self._sentinels(k, num_slots, bucket)
        lens = tuple(real) + (0,) * (num_slots - k)
        layout = BatchLayout(
            mode=ForwardMode.EXTEND,
            req_pool_indices=tuple(range(k)) + (0,) * (num_slots - k),
            prefix_lens=(0,) * num_slots,
            extend_lens=lens,
        )
        return self.view(layout, bucket, num_slots)

    def _sentinels(self, start: int, end: int, num_tokens: int) -> None:
        self.req_pool_indices[start:end].zero_()
        self.prefix_lens[start:end].zero_()
        self.extend_lens[start:end].zero_()
        self.extend_start_loc[start:end].fill_(num_tokens)
