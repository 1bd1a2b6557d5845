"""A batch's request layout as FlashInfer reads it: indptr arrays and KV slot indices, page size 1.

Every token's K/V lives in its own slot of the token pool, so a "page" is one slot and every
request's last page holds one token. Built on the host from the batch's host copy of the lengths
(no device sync); the KV indices are gathered on the device from the request-to-token table.

For a graph of a fixed request axis (``num_slots``), requests past the real ones are sentinels:
no query rows and one KV entry, the reserved padding slot, so that no kernel sees an empty KV
range and no sentinel ever reads a live request's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.padding import PADDING_SLOT
from service.ranks.forward_batch import BatchLayout


@dataclass(frozen=True)
class PagedLayout:
    qo_indptr: torch.Tensor  # (B+1,) int32, host: query rows of request i are [qo[i], qo[i+1])
    kv_indptr: torch.Tensor  # (B+1,) int32, host: KV entries of request i
    kv_last_page_len: torch.Tensor  # (B,) int32, host: ones (page size 1)
    table_index: torch.Tensor  # (sum of real kv lens,) int64, host: into req_to_token.view(-1)
    num_sentinels: int  # trailing requests that are sentinels

    @property
    def num_requests(self) -> int:
        return self.kv_last_page_len.shape[0]

    @property
    def num_query_rows(self) -> int:
        return int(self.qo_indptr[-1])

    def kv_indices(self, table: torch.Tensor) -> torch.Tensor:
        """(kv_indptr[-1],) int32 on the table's device: each KV entry's pool slot."""
        idx = self.table_index.to(table.device, non_blocking=True)
        real = table.reshape(-1).index_select(0, idx)
        if self.num_sentinels:
            pad = torch.full(
                (self.num_sentinels,), PADDING_SLOT, dtype=real.dtype, device=real.device
            )
            real = torch.cat([real, pad])
        return real.to(torch.int32)


def indptr(lengths: list[int] | tuple[int, ...]) -> torch.Tensor:
    """(n+1,) int32 host offsets of consecutive ranges of these lengths."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return out


def paged_layout(
    layout: BatchLayout, context_length: int, num_slots: int | None = None
) -> PagedLayout:
    """The FlashInfer layout of ``layout``, padded with sentinels to ``num_slots`` requests."""
    real = layout.num_requests
    slots = real if num_slots is None else num_slots
    if slots < real:
        raise ValueError(f"{real} requests do not fit {slots} request slots")
    seq_lens = list(layout.seq_lens)
    if any(n > context_length for n in seq_lens):
        raise ValueError(f"a request of {max(seq_lens)} tokens exceeds context {context_length}")
    sentinels = slots - real
    qo = indptr(list(layout.extend_lens) + [0] * sentinels)
    kv = indptr(seq_lens + [1] * sentinels)
    if seq_lens:
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        rows = torch.tensor(layout.req_pool_indices, dtype=torch.int64)
        starts = torch.repeat_interleave(rows * context_length, lens)  # row base per KV entry
        offsets = torch.arange(int(lens.sum())) - torch.repeat_interleave(kv[:real].long(), lens)
        table_index = starts + offsets
    else:
        table_index = torch.zeros(0, dtype=torch.int64)
    return PagedLayout(
        qo_indptr=qo,
        kv_indptr=kv,
        kv_last_page_len=torch.ones(slots, dtype=torch.int32),
        table_index=table_index,
        num_sentinels=sentinels,
    )
