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

from dataclasses import dataclass, field

import torch

from service.padding import PADDING_POSITION, PADDING_SLOT, PADDING_TOKEN_ID
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.ranks.runners.padded_rows import PaddedRows


@dataclass(frozen=True)
class PrefillStaticBuffers:
    input_ids: torch.Tensor  # (Tmax,) row 0 of ``tokens`` (``padding.rows``)
    positions: torch.Tensor  # (Tmax,) row 1
    out_cache_loc: torch.Tensor  # (Tmax,) row 2
    req_pool_indices: torch.Tensor  # (Cmax,) row 0 of ``requests``
    prefix_lens: torch.Tensor  # (Cmax,) row 1
    extend_lens: torch.Tensor  # (Cmax,) row 2
    extend_start_loc: torch.Tensor  # (Cmax,) row 3
    # the rows above as one tensor each (``tokens``, ``requests``): a packed batch is copied in
    # with one copy per tensor and padded with one more, not a copy and a fill per field (host
    # time before each replay)
    requests: torch.Tensor  # (4, Cmax) int64
    # the token rows (3, Tmax), kept holding the pad token (id, position, KV slot) past each
    # live batch
    padding: PaddedRows = field(compare=False, repr=False)
    # bucket -> its (input_ids, positions, out_cache_loc) slices, made once: slicing costs host
    # time before every replay
    _token_slices: dict[int, tuple[torch.Tensor, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @staticmethod
    def allocate(max_tokens: int, max_requests: int, device: torch.device) -> PrefillStaticBuffers:
        pad = torch.tensor([[PADDING_TOKEN_ID], [PADDING_POSITION], [PADDING_SLOT]],
                           dtype=torch.int64, device=device)  # fmt: skip
        padding = PaddedRows(pad, max_tokens)
        requests = torch.zeros(4, max_requests, dtype=torch.int64, device=device)
        return PrefillStaticBuffers(
            *padding.rows.unbind(0), *requests.unbind(0), requests=requests, padding=padding
        )

    @property
    def tokens(self) -> torch.Tensor:
        """(3, Tmax) int64: input_ids, positions and out_cache_loc as rows of one tensor."""
        return self.padding.rows

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
        packed = self._copy_token_rows(batch, bucket)
        self.requests[:, :b].copy_(packed[3 * n :].view(4, b))
        self._sentinels(b, num_slots, n)
        return self.view(batch.layout, bucket, num_slots)

    def copy_tokens(self, batch: ForwardBatch, bucket: int) -> ForwardBatch:
        """Copy only a real batch's token rows in (ids, positions, KV slots), padded to
        ``bucket``: the view's request tensors are the batch's own (its live requests, no
        sentinel slots). For graphs that read no request tensor (the segment backends' token-axis
        graphs) under attention planned from the host layout: two device ops fewer than
        :meth:`copy_from`, and no sentinel padding."""
        if batch.num_tokens > bucket or bucket > self.max_tokens:
            raise ValueError(
                f"batch of {batch.num_tokens} tokens does not fit bucket {bucket} "
                f"(buffers {self.max_tokens})"
            )
        self._copy_token_rows(batch, bucket)
        got = self._token_slices.get(bucket)
        if got is None:
            got = self._token_slices[bucket] = (
                self.input_ids[:bucket], self.positions[:bucket], self.out_cache_loc[:bucket]
            )  # fmt: skip
        return ForwardBatch(
            batch.layout, *got, batch.req_pool_indices, batch.prefix_lens, batch.extend_lens,
            batch.extend_start_loc,
        )  # fmt: skip

    def _copy_token_rows(self, batch: ForwardBatch, bucket: int) -> torch.Tensor:
        n, b = batch.num_tokens, batch.layout.num_requests
        packed = batch.packed
        if packed is None or packed.numel() != 3 * n + 4 * b:
            raise ValueError("a replayed batch must be one built by ForwardBatch.build (packed)")
        # the batch's seven tensors are rows of (3, n) and (4, b) slices of one tensor
        self.padding.write(packed[: 3 * n].view(3, n), bucket)
        return packed

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
        # synthetic positions are not the pad token's: the next real batch pads over them
        self.padding.dirtied(bucket)
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
        if start < end:
            self.requests[:3, start:end].zero_()  # row 0, prefix 0, extend 0
            self.extend_start_loc[start:end].fill_(num_tokens)
