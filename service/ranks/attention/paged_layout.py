"""A batch's request layout as FlashInfer reads it: indptr arrays and KV slot indices, page size 1.

Every token's K/V lives in its own slot of the token pool, so a "page" is one slot and every
request's last page holds one token. Built on the host from the batch's host copy of the lengths
(no device sync) with numpy: this runs before every decode step and graph replay, where a dozen
small torch CPU ops cost ~250 us and each releases the GIL that the HTTP thread competes for.
The KV indices are gathered on the device from the request-to-token table.

For a graph of a fixed request axis (``num_slots``), requests past the real ones are sentinels:
no query rows and one KV entry, the reserved padding slot, so that no kernel sees an empty KV
range and no sentinel ever reads a live request's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from service.padding import PADDING_SLOT
from service.ranks.forward_batch import BatchLayout
from service.ranks.host_staging import host_buffer


@dataclass(frozen=True)
class PagedLayout:
    qo_indptr: torch.Tensor  # (B+1,) int32, host: query rows of request i are [qo[i], qo[i+1])
    kv_indptr: torch.Tensor  # (B+1,) int32, host: KV entries of request i
    kv_last_page_len: torch.Tensor  # (B,) int32, host: ones (page size 1)
    table_index: torch.Tensor  # (sum of real kv lens,) int64, host: into req_to_token.view(-1)
    num_sentinels: int  # trailing requests that are sentinels
    # what FlashInfer's plan would otherwise derive with small torch ops on every plan
    kv_lens: torch.Tensor  # (B,) int32, host: KV entries per request
    max_q_len: int
    max_kv_len: int

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


def _offsets(lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(n+1,) int32 offsets of consecutive ranges of these lengths."""
    if out is None:
        out = np.empty(len(lengths) + 1, dtype=np.int32)
    out[0] = 0
    np.add.accumulate(lengths, out=out[1:], dtype=out.dtype)  # np.cumsum: a costlier wrapper
    return out


def indptr(lengths: list[int] | tuple[int, ...], pin: bool = False) -> torch.Tensor:
    """(n+1,) int32 host offsets of consecutive ranges of these lengths."""
    t, a = host_buffer(len(lengths) + 1, torch.int32, pin)
    _offsets(np.asarray(lengths, dtype=np.int64), a)
    return t


def paged_layout(
    layout: BatchLayout, context_length: int, num_slots: int | None = None, pin: bool = False
) -> PagedLayout:
    """The FlashInfer layout of ``layout``, padded with sentinels to ``num_slots`` requests;
    ``pin``: its host tensors in pinned memory (they are copied to a CUDA device)."""
    real = layout.num_requests
    slots = real if num_slots is None else num_slots
    if slots < real:
        raise ValueError(f"{real} requests do not fit {slots} request slots")
    sentinels = slots - real
    seq = np.asarray(layout.seq_lens, dtype=np.int64)
    if real and int(seq.max()) > context_length:
        raise ValueError(f"a request of {int(seq.max())} tokens exceeds context {context_length}")
    extend = np.zeros(slots, dtype=np.int64)
    extend[:real] = layout.extend_lens
    kv_lens = np.ones(slots, dtype=np.int64)  # a sentinel holds one entry: the padding slot
    kv_lens[:real] = seq
    # one int32 host buffer: qo_indptr | kv_indptr | kv_last_page_len | kv_lens
    small, a = host_buffer(4 * slots + 2, torch.int32, pin)
    _offsets(extend, a[: slots + 1])
    kv = _offsets(kv_lens, a[slots + 1 : 2 * slots + 2])
    a[2 * slots + 2 : 3 * slots + 2] = 1
    a[3 * slots + 2 :] = kv_lens
    # entry j of request i reads table[row_i, j]: flat index row_i * context + (e - kv[i])
    rows = np.asarray(layout.req_pool_indices, dtype=np.int64)
    base = np.repeat(rows * context_length - kv[:real], seq)
    table_index, ti = host_buffer(base.shape[0], torch.int64, pin)
    np.add(base, np.arange(base.shape[0], dtype=np.int64), out=ti)
    return PagedLayout(
        qo_indptr=small[: slots + 1],
        kv_indptr=small[slots + 1 : 2 * slots + 2],
        kv_last_page_len=small[2 * slots + 2 : 3 * slots + 2],
        table_index=table_index,
        num_sentinels=sentinels,
        kv_lens=small[3 * slots + 2 :],
        max_q_len=int(extend.max()) if slots else 0,
        max_kv_len=int(kv_lens.max()) if slots else 0,
    )
