"""One forward pass worth of batch layout: the token axis and the request axis.

Prefill (extend) batches carry each request's cached prefix length and its new tokens, so
chunked prefill is an extend on top of an existing prefix; decode is an extend of one token per
request. Host copies of the per-request lengths are kept beside the device tensors because eager
attention and the scheduler need them without a device sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from service.ranks.host_staging import host_buffer, upload


class ForwardMode(Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass(frozen=True)
class BatchLayout:
    """Per-request lengths on the host: the part of a batch that is identical on every rank."""

    mode: ForwardMode
    req_pool_indices: tuple[int, ...]
    prefix_lens: tuple[int, ...]  # tokens already in the KV cache
    extend_lens: tuple[int, ...]  # new tokens this pass

    def __post_init__(self) -> None:
        n = len(self.req_pool_indices)
        if not (len(self.prefix_lens) == len(self.extend_lens) == n):
            raise ValueError("req_pool_indices, prefix_lens and extend_lens differ in length")

    @property
    def num_requests(self) -> int:
        return len(self.req_pool_indices)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True))


@dataclass
class ForwardBatch:
    """Device tensors of a batch. Token axis T (maybe padded), request axis B (maybe with slots).

    Padding invariant: padded tokens (index >= layout.num_tokens) have ``out_cache_loc == 0``,
    the reserved KV slot, so their K/V writes never touch a live request's entries.
    """

    layout: BatchLayout
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    out_cache_loc: torch.Tensor  # (T,) int64, KV slot each token writes
    req_pool_indices: torch.Tensor  # (B,) int64
    prefix_lens: torch.Tensor  # (B,) int64
    extend_lens: torch.Tensor  # (B,) int64
    extend_start_loc: torch.Tensor  # (B,) int64, first token of each request on the token axis
    # (3T + 4B,) int64: the seven tensors above, in that order, as slices of one tensor (what
    # ``build`` makes); lets a graph runner copy a batch into its static buffers in two copies
    packed: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    @staticmethod
    def build(
        layout: BatchLayout,
        input_ids: list[int],
        out_cache_loc: list[int],
        device: torch.device,
    ) -> ForwardBatch:
        """The batch's device tensors, built on the host without a Python loop over requests and
        moved to the device in one copy (slices of one packed tensor)."""
        t, b = layout.num_tokens, layout.num_requests
        if len(input_ids) != t or len(out_cache_loc) != t:
            raise ValueError(
                f"batch has {t} new tokens but {len(input_ids)} ids and "
                f"{len(out_cache_loc)} cache slots"
            )
        # numpy on the host (small torch CPU ops cost microseconds each and release the GIL),
        # written straight into one pinned buffer: one host-to-device copy per batch
        lens = np.asarray(layout.extend_lens, dtype=np.int64)
        prefix = np.asarray(layout.prefix_lens, dtype=np.int64)
        starts = np.zeros(b, dtype=np.int64)
        np.add.accumulate(lens[:-1], out=starts[1:])  # np.cumsum: a costlier wrapper
        host, a = host_buffer(3 * t + 4 * b, torch.int64, pin=device.type == "cuda")
        a[:t] = input_ids
        # token j of request i sits at position prefix[i] + (j - starts[i])
        a[t : 2 * t] = np.repeat(prefix - starts, lens) + np.arange(t, dtype=np.int64)
        a[2 * t : 3 * t] = out_cache_loc
        a[3 * t : 3 * t + b] = layout.req_pool_indices
        a[3 * t + b : 3 * t + 2 * b] = prefix
        a[3 * t + 2 * b : 3 * t + 3 * b] = lens
        a[3 * t + 3 * b :] = starts
        packed = upload(host, device)
        ids, pos, loc, r, p, e, st = packed.split([t, t, t, b, b, b, b])
        return ForwardBatch(
            layout=layout,
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            req_pool_indices=r,
            prefix_lens=p,
            extend_lens=e,
            extend_start_loc=st,
            packed=packed,
        )

    def last_token_indices(self) -> torch.Tensor:
        """(B,) index of each request's last new token on the token axis."""
        return self.extend_start_loc + self.extend_lens - 1
