"""Which CTA runs which work item of FlashInfer's SM90 (FA3) prefill kernel: a pure policy on
numpy arrays, no torch.

Why: FlashInfer's SM90 plan hands the work items (one per query tile of 128 rows, per request,
per query head) to a persistent grid of one CTA per SM, each item to the CTA with the least
work so far, in the order head by head and, within a head, from the last query tile to the
first. Under a causal mask the last tile attends over the whole sequence and the first over
one tile, so a head's short tiles fill idle CTAs before the next heads' long tiles come. At
one sequence of 2,048 tokens and 12 heads (192 items on 132 SMs) the busiest CTA then holds
21 tiles' worth of KV where the longest single item holds 16, the bound no reordering can
beat: the kernel takes about a third longer than it has to. Ordering all items longest first
(across heads) before dealing them out is the classic longest-processing-time rule.

Dealt in a snake (CTA 0..n-1, then n-1..0, ...), the sorted items give each CTA one item of each
round, the CTAs that got the longest items of one round getting the shortest of the next: close
to the longest-first rule's heap walk (the same busiest CTA at one to four sequences of 2,048 to
8,192 tokens; a few percent over it where a few long sequences share the batch with short ones),
in a few vectorised numpy steps instead of a Python loop per item, because it runs on the host
before every replay of a captured prefill. Where it would not shorten the busiest CTA of
FlashInfer's own schedule, that schedule stays.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

CTA_TILE_Q = 128  # query rows per work item (FlashInfer's SM90 plan: 192 at head_dim 64)


def tile_rows(head_dim: int) -> int:
    return 192 if head_dim == 64 else CTA_TILE_Q


def item_costs(
    tile: np.ndarray, qo_len: np.ndarray, kv_len: np.ndarray, rows: int = CTA_TILE_Q
) -> np.ndarray:
    """FlashInfer's own cost model of a causal work item, in KV rows: twice the query tile (the
    fixed part: load Q, write O) plus the KV rows its tile attends over (right-aligned: a
    request with a cached prefix attends over the prefix too)."""
    end = np.minimum(kv_len - qo_len + (np.asarray(tile) + 1) * rows, kv_len)
    # the last tile attends over all the KV rows (its end is past them, or they are all prefix)
    last = np.asarray(tile) + 1 == -(-np.asarray(qo_len) // rows)
    return 2 * rows + np.where(last, kv_len, np.maximum(end, 0))


def makespan(costs: np.ndarray, work_indptr: np.ndarray) -> int:
    """The busiest CTA's cost when CTA i runs items work_indptr[i]:work_indptr[i+1]."""
    prefix = np.zeros(costs.shape[0] + 1, dtype=np.int64)
    np.cumsum(costs, dtype=np.int64, out=prefix[1:])
    return int((prefix[work_indptr[1:]] - prefix[work_indptr[:-1]]).max(initial=0))


@dataclass(frozen=True)
class Schedule:
    """Items in the order the CTAs take them (``order[j]``: the plan's item that goes j-th) and
    each CTA's range of that order."""

    order: np.ndarray  # (n,) int64: a permutation of the plan's items
    work_indptr: np.ndarray  # (num_ctas+1,) int64, from 0 to n


@functools.lru_cache(maxsize=256)
def _dealt(n: int, num_ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions in the longest-first list, CTA by CTA in the order each CTA is dealt them, and
    the CTA ranges: the snake depends on the item count alone (cached, read-only)."""
    # one row a round, odd rounds dealt from the last CTA back
    rounds = -(-n // num_ctas)
    grid = np.arange(rounds * num_ctas).reshape(rounds, num_ctas)
    grid[1::2] = grid[1::2, ::-1]
    dealt = grid.T.ravel()
    dealt = dealt[dealt < n]
    work_indptr = np.zeros(num_ctas + 1, dtype=np.int64)
    np.cumsum((grid < n).sum(0), out=work_indptr[1:])
    dealt.flags.writeable = work_indptr.flags.writeable = False
    return dealt, work_indptr


def snake(costs: np.ndarray, num_ctas: int) -> Schedule:
    """Longest items first, dealt to the CTAs in a snake; ties keep the plan's order."""
    if num_ctas <= 0:
        raise ValueError(f"num_ctas {num_ctas} must be positive")
    dealt, work_indptr = _dealt(costs.shape[0], num_ctas)
    by_cost = np.argsort(-np.asarray(costs, dtype=np.int64), kind="stable")
    return Schedule(order=by_cost[dealt], work_indptr=work_indptr)


def rebalanced(costs: np.ndarray, work_indptr: np.ndarray) -> Schedule | None:
    """The snake schedule of these items over as many CTAs as ``work_indptr`` has, or None where
    it would not shorten the busiest CTA of the plan's schedule (``work_indptr``, the plan's
    items in their order): with no more items than CTAs every item has a CTA of its own
    either way."""
    num_ctas = work_indptr.shape[0] - 1
    if costs.shape[0] <= num_ctas:
        return None
    ours = snake(costs, num_ctas)
    if makespan(costs[ours.order], ours.work_indptr) >= makespan(costs, work_indptr):
        return None
    return ours


@dataclass(frozen=True)
class Planned:
    """A whole SM90 schedule, made from the request lengths alone: the arrays FlashInfer's plan
    fills (sm90_schedule.ITEM_FIELDS but the batch, as rows; the batch indices; the CTA ranges),
    in the order the CTAs take the items."""

    block: np.ndarray  # (6, n) int64: tile, qo_indptr, kv_indptr, qo_len, kv_len, head
    batch: np.ndarray  # (n,) int64: each item's request
    work_indptr: np.ndarray  # (num_ctas+1,) int64

    def rows(self) -> np.ndarray:
        """The items as (n, 7) rows of sm90_schedule.ITEM_FIELDS (the block's fields, then the
        batch), in CTA order."""
        return np.concatenate([self.block, self.batch[None, :]]).T


def item_count(lengths: np.ndarray | list[int], heads: int, rows: int = CTA_TILE_Q) -> int:
    """How many work items FlashInfer's SM90 plan makes of these query lengths (no cached
    prefix): one per query tile, per request, per query head. Plain Python over the slots: it
    runs at every replan, and numpy's ops on a few slots cost 12 us there on an H100's host
    (docs/benchmarks.md, session 54)."""
    values = lengths.tolist() if isinstance(lengths, np.ndarray) else lengths
    return heads * int(sum(-(-n // rows) for n in values))


def max_item_count(num_tokens: int, num_slots: int, heads: int, rows: int = CTA_TILE_Q) -> int:
    """The most work items (:func:`item_count`) any plan of at most ``num_tokens`` query rows over
    ``num_slots`` request slots can make: each filled slot's first row opens a tile and every
    ``rows`` more open another, so the count is largest with as many requests as slots and rows
    allow, all but one of a single row (attained: ``item_count`` of that batch is this bound)."""
    filled = min(num_slots, num_tokens)
    return heads * (filled + (num_tokens - filled) // rows)


def planned(lengths: np.ndarray, heads: int, num_ctas: int, rows: int = CTA_TILE_Q) -> Planned:
    """The dealt schedule of a prefill without a cached prefix (query and KV ranges equal), from
    its request lengths (sentinel slots: 0): FlashInfer's items (every query tile of every
    request, per head), listed heads outer, requests in slot order, tiles last to first, then
    dealt in the snake, ties in that order. What ``sm90_triton.plan`` writes on the device, where
    FlashInfer's host plan and the rewrite after it are skipped: the items are the plan's (a
    multiset: FlashInfer lists requests by length), the schedule is the snake's even where
    FlashInfer's heap would have been as short."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tiles = -(-lengths // rows)
    per_head = int(tiles.sum())
    req = np.repeat(np.arange(lengths.shape[0]), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    tile = tiles[req] - 1 - (np.arange(per_head) - first)
    req, tile = np.tile(req, heads), np.tile(tile, heads)
    head = np.repeat(np.arange(heads), per_head)
    lens = lengths[req]
    schedule = snake(item_costs(tile, lens, lens, rows), num_ctas)
    block = np.stack([tile, starts[req], starts[req], lens, lens, head])
    return Planned(block[:, schedule.order], req[schedule.order], schedule.work_indptr)
