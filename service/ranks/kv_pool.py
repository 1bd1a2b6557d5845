"""KV memory like a serving engine: a request-to-token table and a token-to-KV pool.

- ``ReqToTokenPool``: one row per request slot, ``context_length`` wide; row r, column j holds
  the KV slot of token j of the request in slot r. A request can never exceed its row, which is
  why capture must never build a synthetic request longer than ``context_length``.
- ``TokenKVPool``: per layer K and V of shape (num_slots, kv_heads, head_dim). Slot 0 is reserved:
  padded tokens write there, so padding never touches a live request's KV.

The pool is sized from a memory budget; :func:`resolve_max_running_requests` derives the request
pool size from that capacity when the user sets none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.errors import CapacityError
from service.ranks.host_staging import host_buffer, upload


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    dtype: torch.dtype
    # 2: a key and a value per token; 1: one entry that is both (MLA's latent and rotary key,
    # whose values are its first kv_lora_rank columns)
    parts: int = 2

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.parts * self.num_layers * self.num_kv_heads * self.head_dim * elem


def kv_slots_for_budget(layout: KVLayout, budget_bytes: int) -> int:
    """Usable token slots (the reserved padding slot excluded) for a memory budget."""
    return budget_bytes // layout.bytes_per_token - 1


def resolve_max_running_requests(
    user_value: int | None, num_kv_tokens: int, context_length: int, cap: int
) -> int:
    """The request-pool size: the user's, else as many full-context requests as the KV holds.

    Derived values are capped at ``cap`` (request slots cost a ``context_length``-wide row each)
    and are at least 1; a user value is kept as given.
    """
    if num_kv_tokens < context_length:
        raise CapacityError(
            f"the KV cache holds {num_kv_tokens} tokens, less than one request of context_length "
            f"{context_length}; raise --kv-cache-memory-bytes or lower --context-length"
        )
    if user_value is not None:
        return user_value
    return max(1, min(cap, num_kv_tokens // context_length))


class ReqToTokenPool:
    """The table only; which rows are free is decided by the coordinator (service.memory)."""

    def __init__(self, num_rows: int, context_length: int, device: torch.device) -> None:
        self.context_length = context_length
        self.table = torch.zeros(num_rows, context_length, dtype=torch.int64, device=device)

    @property
    def num_rows(self) -> int:
        return self.table.shape[0]

    def write(self, row: int, start: int, slots: list[int]) -> None:
        self.write_many([(row, start, slots)])

    def write_many(self, writes: list[tuple[int, int, list[int] | tuple[int, ...]]]) -> None:
        """``table[row, start : start + len(slots)] = slots`` for every write, in one indexed
        store (one host-to-device copy), not one per request."""
        flat: list[int] = []  # row * context_length + column, into table.view(-1)
        vals: list[int] = []
        ctx = self.context_length
        for row, start, slots in writes:
            end = start + len(slots)
            if end > ctx:
                raise ValueError(
                    f"request row {row} would hold {end} tokens, more than context_length {ctx}"
                )
            flat += range(row * ctx + start, row * ctx + end)
            vals += slots
        if not vals:
            return
        n = len(vals)
        host, a = host_buffer(2 * n, torch.int64, pin=self.table.is_cuda)
        a[:n] = flat
        a[n:] = vals
        packed = upload(host, self.table.device)
        self.table.view(-1).index_copy_(0, packed[:n], packed[n:])


class TokenKVPool:
    """K/V storage; slot allocation is decided by the coordinator (service.scheduling).

    One tensor per layer holds both, (num_slots + 1, 2, Hkv, D): K and V of a token side by side,
    as FlashInfer's combined paged layout reads them (page size 1). ``k[layer]`` and
    ``v[layer]`` are views of it. When k and v arrive as adjacent columns of one qkv projection
    (the model's layout), one indexed copy stores both. A one-part layout (MLA) keeps a single
    entry per token, (num_slots + 1, 1, 1, D); ``k[layer]`` and ``v[layer]`` are the same view.
    """

    def __init__(self, layout: KVLayout, num_slots: int, device: torch.device) -> None:
        self.layout = layout
        self.num_slots = num_slots
        if layout.parts not in (1, 2):
            raise ValueError(f"a KV layout has 1 or 2 parts, not {layout.parts}")
        # +1: the padding slot
        shape = (num_slots + 1, layout.parts, layout.num_kv_heads, layout.head_dim)
        self.kv = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)
        ]
        self.k = [t[:, 0] for t in self.kv]
        self.v = [t[:, layout.parts - 1] for t in self.kv]

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc (T,), k/v (T, Hkv, D). Padded tokens have loc == service.padding.PADDING_SLOT.
        store_entries(self.kv[layer], loc, k, v)


def store_entries(kv: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """One layer's cache (num_slots+1, parts, Hkv, D): each token's K and V (T, Hkv, D) to its
    slot ``loc`` (T,); a one-part layout (MLA) keeps k alone."""
    if kv.shape[1] == 1:  # one entry: v is k
        copy_rows(kv[:, 0], loc, k.to(kv.dtype))
        return
    both = side_by_side(k, v)
    if both is not None and both.dtype == kv.dtype:
        copy_rows(kv, loc, both)  # one kernel for K and V
        return
    copy_rows(kv[:, 0], loc, k.to(kv.dtype))
    copy_rows(kv[:, 1], loc, v.to(kv.dtype))


def copy_rows(dst: torch.Tensor, loc: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[loc[i]] = src[i]`` for every row i, as 8-byte words where both layouts allow it.

    Why: torch's indexed copy computes an offset per element, so its cost goes with the element
    count, not the bytes; bf16 rows moved as int64 words are a quarter of the elements. On the
    H200 a 2,048-token forward's K/V store went from 5.3 to 3.5 us a layer (about 1 us of bytes
    at the copy rate; docs/benchmarks.md, session 28). Same bytes, so the same result bit for
    bit."""
    wide_dst, wide_src = _words(dst), _words(src)
    if wide_dst is not None and wide_src is not None and wide_dst.shape[1:] == wide_src.shape[1:]:
        wide_dst.index_copy_(0, loc, wide_src)
    else:
        dst.index_copy_(0, loc, src)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """t as a view of 8-byte words (its last dim a quarter as long for bf16), or None where its
    layout does not allow one: torch refuses unless the last dim is contiguous and every size in
    bytes, stride and offset is a multiple of 8. One view, no reshape: this runs on the host
    for every store of an eager forward, a layer at a time."""
    try:
        return t.view(torch.int64)
    except RuntimeError:
        return None


def side_by_side(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """k and v (T, Hkv, D) as one (T, 2, Hkv, D) view when v starts where k ends in every row
    (column slices of one qkv tensor), else None."""
    t, h, d = k.shape
    width = h * d
    if (
        v.shape != k.shape
        or v.dtype != k.dtype
        or k.stride() != v.stride()
        or k.stride()[1:] != (d, 1)
        or v.data_ptr() != k.data_ptr() + width * k.element_size()
    ):
        return None
    return k.as_strided((t, 2, h, d), (k.stride(0), width, d, 1))
