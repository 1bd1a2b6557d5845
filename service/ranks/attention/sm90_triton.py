"""FlashInfer's SM90 prefill schedule dealt again on the device: one Triton program (CUDA).

Why on the device: the host rewrite (:class:`~service.ranks.attention.sm90_schedule.SM90Rebalance`,
numpy) cost 0.1-0.3 ms of host time per plan, and ``full`` plans while the device runs its
first graph, so on an H100 that host time left the device idle for about as long as the
balanced schedule saved in the attention kernels (docs/benchmarks.md, sessions 43-44). Here the
same policy runs after FlashInfer's copy of its schedule, in stream order: queued right after a
plan (eager, segment runners), or captured into ``full``'s graph before layer 0's attention, where
the host does nothing at all.

The policy is sm90_balance's, to the item: each item's cost is FlashInfer's cost model
(:func:`~service.ranks.attention.sm90_balance.item_costs`); the items sorted longest first, ties in
the plan's order (a rank by counting: ``rank_i`` = items costlier than i, or as costly and before
it); dealt in a snake over the CTAs (:func:`~service.ranks.attention.sm90_balance.snake`:
sorted position p goes to CTA ``p % C`` on even rounds ``p // C`` and ``C - 1 - p % C`` on odd
ones, as the round-th item of that CTA); written only where it shortens the busiest CTA of
FlashInfer's schedule, and only where FlashInfer's CTA ranges span its items (work_indptr from 0,
non-decreasing, at most the arrays' capacity). Otherwise the region keeps FlashInfer's schedule.

One program: the item counts are small (a few hundred items at 2,048 tokens; the rank is
O(n^2) compares, about 17 M at 4,096 items) and one program needs no second launch to agree on
the busiest CTA. ``src`` is a copy of the region the kernel rewrites (queued just before it):
the permutation reads FlashInfer's arrays there and writes the region.

Imported only where the rank chose the balanced schedule on CUDA with triton installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64  # items per step of each loop


@triton.jit
def _snake_pos(rank, n, NUM_CTAS: tl.constexpr):
    """Where the snake (sm90_balance.snake) puts the item of this longest-first ``rank`` of
    ``n``: its index in the CTA-ordered arrays."""
    r = rank // NUM_CTAS
    k = rank % NUM_CTAS
    cta = tl.where(r % 2 == 0, k, NUM_CTAS - 1 - k)
    return cta * (n // NUM_CTAS) + _snake_lead(cta, n, NUM_CTAS) + r


@triton.jit
def _snake_lead(cta, n, NUM_CTAS: tl.constexpr):
    """How many of the last, partial round's items (``n`` mod NUM_CTAS) go to CTAs before
    ``cta`` (one each): the first CTAs took them when the full rounds are even, the last when
    odd."""
    rem = n % NUM_CTAS
    even = (n // NUM_CTAS) % 2 == 0
    return tl.where(even, tl.minimum(cta, rem), tl.maximum(cta - (NUM_CTAS - rem), 0))


@triton.jit
def _store_snake_ranges(dst_ptr, n, NUM_CTAS: tl.constexpr, CPAD: tl.constexpr):
    """The snake's CTA ranges of ``n`` items (work_indptr, NUM_CTAS + 1 entries) at ``dst_ptr``:
    the full rounds' items each, one more for the CTAs that took the last, partial round (as
    :func:`_snake_pos` places them)."""
    c = tl.arange(0, CPAD)
    lead = _snake_lead(c, n, NUM_CTAS)
    tl.store(dst_ptr + c, c * (n // NUM_CTAS) + lead, mask=c <= NUM_CTAS)


@triton.jit
def _deal_kernel(
    src_ptr,  # int32: a copy of the region [tile .. batch + CAP), as FlashInfer's copy left it
    dst_ptr,  # int32: the region in the int workspace the attention kernel reads
    tmp_ptr,  # int32 scratch: costs (CAP), ranks (CAP), CTA loads (2 * CPAD)
    CAP,  # items each per-item array holds (tile, qo_indptr, kv_indptr, qo_len, kv_len, head
    # lie back to back from 0, then work_indptr at WI and batch at BATCH)
    WI,
    BATCH,
    NUM_CTAS: tl.constexpr,
    CPAD: tl.constexpr,  # a power of two > NUM_CTAS
    ROWS: tl.constexpr,  # query rows per work item
    BLOCK: tl.constexpr,
):
    c = tl.arange(0, CPAD)
    live_cta = c < NUM_CTAS
    wi = tl.load(src_ptr + WI + c, mask=c <= NUM_CTAS, other=0)  # FlashInfer's CTA ranges
    wi_hi = tl.load(src_ptr + WI + 1 + c, mask=live_cta, other=0)
    first = tl.sum(tl.where(c == 0, wi, 0), axis=0)
    n = tl.sum(tl.where(c == NUM_CTAS, wi, 0), axis=0)  # FlashInfer's item count
    ordered = tl.sum(((wi_hi < wi) & live_cta).to(tl.int32), axis=0) == 0
    valid = (first == 0) & (n <= CAP) & (n > NUM_CTAS) & ordered
    loads = tmp_ptr + 2 * CAP
    tl.store(loads + c, tl.zeros([CPAD], dtype=tl.int32))
    tl.store(loads + CPAD + c, tl.zeros([CPAD], dtype=tl.int32))
    if valid:
        # each item's cost (sm90_balance.item_costs)
        for s in range(0, n, BLOCK):
            i = s + tl.arange(0, BLOCK)
            m = i < n
            tile = tl.load(src_ptr + i, mask=m, other=0)
            qo_len = tl.load(src_ptr + 3 * CAP + i, mask=m, other=0)
            kv_len = tl.load(src_ptr + 4 * CAP + i, mask=m, other=0)
            end = tl.minimum(kv_len - qo_len + (tile + 1) * ROWS, kv_len)
            last = tile + 1 == (qo_len + ROWS - 1) // ROWS
            cost = 2 * ROWS + tl.where(last, kv_len, tl.maximum(end, 0))
            tl.store(tmp_ptr + i, cost, mask=m)
        tl.debug_barrier()
        # ranks, longest first with ties in plan order; each CTA's load in both schedules
        for s in range(0, n, BLOCK):
            i = s + tl.arange(0, BLOCK)
            m = i < n
            ci = tl.load(tmp_ptr + i, mask=m, other=0, cache_modifier=".cg")
            rank = tl.zeros([BLOCK], dtype=tl.int32)
            for t in range(0, n, BLOCK):
                j = t + tl.arange(0, BLOCK)
                cj = tl.load(tmp_ptr + j, mask=j < n, other=-1, cache_modifier=".cg")
                before = (cj[None, :] > ci[:, None]) | (
                    (cj[None, :] == ci[:, None]) & (j[None, :] < i[:, None])
                )
                rank += tl.sum(before.to(tl.int32), axis=1)
            tl.store(tmp_ptr + CAP + i, rank, mask=m)
            # FlashInfer's CTA of item i: the CTAs whose range ends at or before i
            old = tl.sum(((wi_hi[None, :] <= i[:, None]) & live_cta[None, :]).to(tl.int32), axis=1)
            tl.atomic_add(loads + old, ci, mask=m)
            r = rank // NUM_CTAS
            k = rank % NUM_CTAS
            new = tl.where(r % 2 == 0, k, NUM_CTAS - 1 - k)
            tl.atomic_add(loads + CPAD + new, ci, mask=m)
        tl.debug_barrier()
        old_max = tl.max(tl.load(loads + c, mask=live_cta, other=0, cache_modifier=".cg"), axis=0)
        new_max = tl.max(
            tl.load(loads + CPAD + c, mask=live_cta, other=0, cache_modifier=".cg"), axis=0
        )
        if new_max < old_max:
            for s in range(0, n, BLOCK):
                i = s + tl.arange(0, BLOCK)
                m = i < n
                rank = tl.load(tmp_ptr + CAP + i, mask=m, other=0, cache_modifier=".cg")
                pos = _snake_pos(rank, n, NUM_CTAS)
                for f in range(6):
                    v = tl.load(src_ptr + f * CAP + i, mask=m)
                    tl.store(dst_ptr + f * CAP + pos, v, mask=m)
                b = tl.load(src_ptr + BATCH + i, mask=m)
                tl.store(dst_ptr + BATCH + pos, b, mask=m)
            _store_snake_ranges(dst_ptr + WI, n, NUM_CTAS, CPAD)


@triton.jit
def _plan_kernel(
    indptr_ptr,  # int32 (S+1,): the query (= KV) row ranges of the request slots
    dst_ptr,  # int32: the region in the int workspace the attention kernel reads (as in deal)
    S,  # request slots (sentinels: empty ranges)
    HEADS,  # query heads
    CAP,
    WI,
    BATCH,
    NUM_CTAS: tl.constexpr,
    CPAD: tl.constexpr,  # a power of two > NUM_CTAS
    SPAD: tl.constexpr,  # a power of two > S
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """sm90_balance.planned, item for item. Item j (heads outer, requests in slot order, tiles
    last to first) is found from the requests' tile counts; its place in the longest-first order
    (ties in j's order) is counted per request in closed form, not by comparing items: a
    request of L rows and k tiles has tiles whose attended rows (the cost less its fixed part)
    are R, 2R, ..., (k-1)R, then L for the last."""
    s = tl.arange(0, SPAD)
    live = s < S
    lo = tl.load(indptr_ptr + s, mask=live, other=0)
    lens = tl.load(indptr_ptr + 1 + s, mask=live, other=0) - lo
    tiles = (lens + ROWS - 1) // ROWS
    ends = tl.cumsum(tiles, axis=0)
    starts = ends - tiles
    per_head = tl.sum(tiles, axis=0)
    n = HEADS * per_head
    if n <= CAP:  # the host checks it too; a plan past the arrays is left as it was
        for b in range(0, n, BLOCK):
            j = b + tl.arange(0, BLOCK)
            m = j < n
            head = j // tl.maximum(per_head, 1)
            r = j - head * per_head
            mine = (starts[None, :] <= r[:, None]) & (r[:, None] < ends[None, :])
            req = tl.sum(tl.where(mine, s[None, :], 0), axis=1)
            length = tl.sum(tl.where(mine, lens[None, :], 0), axis=1)
            k = tl.sum(tl.where(mine, tiles[None, :], 0), axis=1)
            first = tl.sum(tl.where(mine, starts[None, :], 0), axis=1)
            q0 = tl.sum(tl.where(mine, lo[None, :], 0), axis=1)
            tile = k - 1 - (r - first)
            v = tl.minimum((tile + 1) * ROWS, length)  # rows attended: the cost less 2 ROWS
            # per request: its tiles attending more rows than v, and as many (at most one)
            whole = tiles[None, :] - 1  # tiles before the last: R, 2R, ... rows
            steps = v[:, None] // ROWS
            more = whole - tl.minimum(whole, steps) + (lens[None, :] > v[:, None]).to(tl.int32)
            same = ((v[:, None] % ROWS == 0) & (steps <= whole)) | (lens[None, :] == v[:, None])
            real = live[None, :] & (tiles[None, :] > 0)
            more = tl.where(real, more, 0)
            same = (same & real).to(tl.int32)
            rank = (
                HEADS * tl.sum(more, axis=1)
                + head * tl.sum(same, axis=1)
                + tl.sum(tl.where(s[None, :] < req[:, None], same, 0), axis=1)
            )
            pos = _snake_pos(rank, n, NUM_CTAS)
            tl.store(dst_ptr + pos, tile, mask=m)
            tl.store(dst_ptr + CAP + pos, q0, mask=m)
            tl.store(dst_ptr + 2 * CAP + pos, q0, mask=m)
            tl.store(dst_ptr + 3 * CAP + pos, length, mask=m)
            tl.store(dst_ptr + 4 * CAP + pos, length, mask=m)
            tl.store(dst_ptr + 5 * CAP + pos, head, mask=m)
            tl.store(dst_ptr + BATCH + pos, req, mask=m)
        _store_snake_ranges(dst_ptr + WI, n, NUM_CTAS, CPAD)


def plan(
    indptr: torch.Tensor,
    dst: torch.Tensor,
    heads: int,
    capacity: int,
    work_indptr_at: int,
    batch_at: int,
    num_ctas: int,
    rows: int,
) -> None:
    """Queue the planner: ``dst`` (int32, the region) written with sm90_balance.planned's
    schedule of the request slots whose row ranges ``indptr`` (int32, S+1, on the device) holds.
    Offsets are in int32 elements from the region's start."""
    slots = indptr.shape[0] - 1
    _plan_kernel[(1,)](
        indptr, dst, slots, heads, capacity, work_indptr_at, batch_at,
        NUM_CTAS=num_ctas, CPAD=triton.next_power_of_2(num_ctas + 1),
        SPAD=triton.next_power_of_2(slots + 1), ROWS=rows, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip


def deal(
    src: torch.Tensor,
    dst: torch.Tensor,
    tmp: torch.Tensor,
    capacity: int,
    work_indptr_at: int,
    batch_at: int,
    num_ctas: int,
    rows: int,
) -> None:
    """Queue the kernel: ``dst`` (int32, the region) rewritten from ``src`` (its copy), with
    ``tmp`` (int32, at least 2 * capacity + 2 * next_power_of_2(num_ctas + 1)) as scratch.
    Offsets are in int32 elements from the region's start."""
    cpad = triton.next_power_of_2(num_ctas + 1)
    if tmp.numel() < scratch_size(capacity, num_ctas):
        raise ValueError(f"scratch of {tmp.numel()} int32 < {scratch_size(capacity, num_ctas)}")
    _deal_kernel[(1,)](
        src, dst, tmp, capacity, work_indptr_at, batch_at,
        NUM_CTAS=num_ctas, CPAD=cpad, ROWS=rows, BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip


def scratch_size(capacity: int, num_ctas: int) -> int:
    return 2 * capacity + 2 * triton.next_power_of_2(num_ctas + 1)
