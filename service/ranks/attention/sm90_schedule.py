"""FlashInfer's SM90 prefill schedule, dealt again longest items first (the policy:
:mod:`~service.ranks.attention.sm90_balance`).

FlashInfer's SM90 plan writes its schedule, eight int32 arrays, into the wrapper's pinned host
buffer and queues one copy of it into the int workspace the kernel reads. :class:`SM90Rebalance`
runs after that plan: it reads the items back from the pinned buffer (FlashInfer's items, every
one kept as it is: only which CTA runs it, and in which order, changes), deals them again, and
queues one copy of the rewritten arrays behind FlashInfer's own on the same stream. Every item
is computed by the same code whichever CTA runs it, so the output is bit-identical.

Checked, not assumed: the plan info must have the SM90 layout (nine fields, offsets in
FlashInfer's allocation order, one schedule per head), and the schedule's CTA ranges must run
from 0 to the item count within the arrays' allocation. A plan that fails a check keeps
FlashInfer's schedule, and the first failure is logged. The items are FlashInfer's own,
permuted, so none can be lost or repeated.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from service.ranks.attention.sm90_balance import (
    CTA_TILE_Q,
    item_costs,
    item_count,
    max_item_count,
    planned,
    rebalanced,
    tile_rows,
)

log = logging.getLogger(__name__)

# PrefillPlanSM90Info::ToVector: byte offsets into the int workspace, then a flag
FIELDS = ("tile", "qo_indptr", "kv_indptr", "qo_len", "kv_len", "head", "work_indptr", "batch")
ITEM_FIELDS = tuple(f for f in FIELDS if f != "work_indptr")
BLOCK_FIELDS = FIELDS[:6]  # tile, qo_indptr, kv_indptr, qo_len, kv_len, head


@dataclass(frozen=True)
class Layout:
    """Where one plan's arrays lie in the int workspace, in int32 elements."""

    at: dict[str, int]  # field -> element offset
    capacity: int  # items each per-item array holds
    start: int  # the region the arrays span: [start, end)
    end: int

    @staticmethod
    def of(info: Any, num_ctas: int) -> Layout | None:
        """The layout of an SM90 plan info, or None for another layout or a plan that shares one
        schedule between heads (more than 4,096 tiles a head)."""
        values = [int(v) for v in info]
        if len(values) != len(FIELDS) + 1 or values[-1] != 0:
            return None
        offsets = values[:-1]
        if any(o % 4 for o in offsets) or sorted(offsets) != offsets:
            return None  # not allocated in FlashInfer's order
        at = {f: o // 4 for f, o in zip(FIELDS, offsets, strict=True)}
        capacity = at["qo_indptr"] - at["tile"]
        end = at["batch"] + capacity
        if capacity <= 0 or at["batch"] - at["work_indptr"] < num_ctas + 1:
            return None
        # the six arrays before work_indptr, back to back: read and written as one block
        if any(at[f] != at["tile"] + k * capacity for k, f in enumerate(BLOCK_FIELDS)):
            return None
        return Layout(at=at, capacity=capacity, start=at["tile"], end=end)

    def local(self, field: str) -> int:
        """``field``'s offset within the region [start, end): where the arrays' device view (and
        the kernels, which are given that view) find it."""
        return self.at[field] - self.start


# a plan's layout, the int32 view of its pinned schedule buffer, and the device region it spans
Placed = tuple[Layout, np.ndarray, torch.Tensor]


class SM90Rebalance:
    """Rewrites the SM90 schedule of FlashInfer prefill wrappers that share one int workspace
    on ``device``, after each of their plans.

    Two ways, one policy. On the device (CUDA with triton: :mod:`sm90_triton`): a kernel queued
    after FlashInfer's copy reads the items there and writes them back dealt again; the host
    only finds the layout (once per wrapper in CUDA-graph mode). ``full`` captures that kernel
    into its graph instead (``defer``, then :meth:`launch` inside the capture). On the host
    (numpy; CPU tests, CUDA without triton): the items are read from the pinned buffer FlashInfer
    wrote, dealt, and copied up behind FlashInfer's copy. One pinned staging buffer serves every
    wrapper: only one plan is in flight at a time, and its copy is waited for before the next
    overwrites it."""

    def __init__(
        self, device: torch.device, num_ctas: int | None = None, on_device: bool | None = None
    ) -> None:
        """``num_ctas``: the kernel's grid (FlashInfer's: one CTA per SM of ``device``); given,
        on a CPU ``device``, the rewrite runs on host tensors (tests of the layout).
        ``on_device``: deal on the device (default: on CUDA where triton imports)."""
        self.device = device
        cuda = device.type == "cuda"
        if num_ctas is None:
            num_ctas = torch.cuda.get_device_properties(device).multi_processor_count
        self.num_ctas = num_ctas
        if on_device is None:
            on_device = cuda and _device_rewrite_checked(device, num_ctas)
        if on_device and not cuda:
            raise ValueError("the device rewrite needs a CUDA device")
        self.on_device = on_device
        # the whole schedule made on the device from the request lengths (sm90_triton.plan),
        # FlashInfer's host plan skipped: where its start-up probe plans as the reference does
        self.plans_on_device = on_device and cuda and _device_plan_checked(device, num_ctas)
        # whether a segment backend's plan of at most one item per CTA replays the planner
        # graph too (True) or goes through FlashInfer's host plan (False; see replay_plan)
        self.small_plans_on_device = False
        # id(wrapper) -> (its device int buffer, the kernel's copy of the region, its scratch)
        self._scratch: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # id(wrapper) -> the kernel captured for it in ``full``'s graph ("deal" or "plan") and
        # the layout it was recorded for
        self._captured: dict[int, tuple[str, Placed]] = {}
        # id(wrapper) -> a segment backend's plan of it as one CUDA graph (the replan's indptr
        # copy, then the planner) and the layout it was captured for (capture_plan)
        self._plan_graphs: dict[int, tuple[torch.cuda.CUDAGraph, Placed]] = {}
        # id(wrapper) -> (plan info, its pinned and device int buffers, its placed layout or None)
        self._layouts: dict[int, tuple[Any, torch.Tensor, torch.Tensor, Placed | None]] = {}
        self._stage = torch.empty(0, dtype=torch.int32)
        self._stage_np = self._stage.numpy()
        self._pin = cuda
        self._copied = torch.cuda.Event() if cuda else None
        self._pending = False
        self._failed: str | None = None  # the first failed check, logged once
        self.applied = 0  # plans whose schedule was rewritten
        self.kept = 0  # plans whose schedule was already as short (or checks failed)
        self.device_plans = 0  # plans made by the planner instead of FlashInfer's host plan

    def __call__(
        self, wrapper: Any, head_dim: int, same_info: bool = False, defer: bool = False
    ) -> bool:
        """Deal ``wrapper``'s last plan again if that shortens its busiest CTA; True if done (on
        the device: queued, the kernel decides). ``same_info``: the caller checked that this
        plan's info equals the wrapper's previous one (RaggedReplan's fast path), so its layout
        is the one kept. ``defer`` (on the device only): nothing is queued, a kernel captured by
        :meth:`launch` deals it; this plan's layout must be the one captured."""
        if getattr(wrapper, "_backend", None) != "fa3":
            return False
        got = self._layout(wrapper, same_info)
        if got is None:
            return self._keep("the plan info is not FlashInfer's SM90 layout")
        if self.on_device:
            if not defer:
                # an item per CTA at most (one request of up to 1,024 tokens): the kernel could
                # only keep the plan, and its launch is host time a segment backend's device
                # waits for at small buckets (docs/benchmarks.md, session 45). Read from the
                # pinned buffer this plan wrote; a capture always takes the kernel, since its
                # replays will deal other plans
                if self._items_fit_ctas(got) and not torch.cuda.is_current_stream_capturing():
                    self.kept += 1
                    return False
                return self._deal_on_device(wrapper, head_dim, got)
            captured = self._captured.get(id(wrapper))
            if captured is not None and captured[1] is not got:
                raise RuntimeError(
                    "FlashInfer's SM90 plan layout changed under a captured schedule kernel; "
                    "the captured graph is no longer valid (run with --prefill-schedule own)"
                )
            return True
        if defer:
            raise ValueError("a deferred rewrite needs the device rewrite (on_device)")
        layout, host, region = got
        at = layout.at
        work_indptr = host[at["work_indptr"] : at["work_indptr"] + self.num_ctas + 1]
        n = int(work_indptr[-1])
        if n <= self.num_ctas:  # an item per CTA at most, in either schedule: nothing to gain
            self.kept += 1
            return False
        if work_indptr[0] != 0 or n > layout.capacity or (work_indptr[1:] < work_indptr[:-1]).any():
            return self._keep(f"the CTA ranges {work_indptr[[0, -1]]} do not span the items")
        block, batch, costs = self._items(layout, host, n, head_dim)
        schedule = rebalanced(costs, work_indptr)
        if schedule is None:
            self.kept += 1
            return False
        self._wait()
        cap, start = layout.capacity, layout.start
        length = layout.end - start
        if self._stage.numel() < length:
            self._stage = torch.empty(length, dtype=torch.int32, pin_memory=self._pin)
            self._stage_np = self._stage.numpy()
        stage = self._stage_np
        stage[:length] = host[start : layout.end]  # what lies between the arrays too
        stage[: 6 * cap].reshape(6, cap)[:, :n] = block[:, schedule.order]
        i = layout.local("batch")
        stage[i : i + n] = batch[schedule.order]
        i = layout.local("work_indptr")
        stage[i : i + self.num_ctas + 1] = schedule.work_indptr
        # FlashInfer's copy of the same region is queued before this one on the same stream, so
        # ours lands last
        region.copy_(self._stage[:length], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._pending = True
        self.applied += 1
        return True

    def may_deal(self, num_tokens: int, num_slots: int, heads: int, head_dim: int) -> bool:
        """Whether some plan of up to ``num_tokens`` query rows over ``num_slots`` request slots
        can have more items than CTAs (:func:`max_item_count`), the only plans this schedule
        changes: where none can, a wrapper's plans are FlashInfer's as made, and the checks and
        the planner graph after each plan would be host time for nothing."""
        return max_item_count(num_tokens, num_slots, heads, tile_rows(head_dim)) > self.num_ctas

    def may_deal_plan(self, heads: int, head_dim: int, lengths: np.ndarray) -> bool:
        """Whether a segment backend's replan of request slots of these query ``lengths`` can
        take the planner or a rewrite: more items than CTAs, or small plans on the device. False
        (counted as kept) where every hook after the module's plan would decline, so the replan
        asks none of them (each looked its layout up again to decline: host time before the
        first attention at small buckets). The count is the one :meth:`replay_plan` and
        :meth:`plan` decide on (:func:`item_count`)."""
        if self.small_plans_on_device or (
            item_count(lengths, heads, tile_rows(head_dim)) > self.num_ctas
        ):
            return True
        self.kept += 1
        return False

    def plan(
        self,
        wrapper: Any,
        heads: int,
        head_dim: int,
        indptr: torch.Tensor,
        lengths: np.ndarray,
        defer: bool = False,
    ) -> bool:
        """Plan ``wrapper`` (a CUDA-graph ragged wrapper, planned once through FlashInfer, whose
        query and KV ranges are the same) for request slots of these query ``lengths`` on the
        device, in place of FlashInfer's host plan and the rewrite after it: the planner
        (:func:`sm90_triton.plan`) reads the slots' row ranges from ``indptr`` (the wrapper's
        device indptr, the caller's copy of this plan's queued before) and writes the whole dealt
        schedule. True where it did (or, ``defer``, where ``full``'s graph holds the planner,
        captured by :meth:`launch_plan`); False where the caller must plan through FlashInfer:
        no trusted planner, not an SM90 layout, more items than the arrays hold, or (not
        deferred) at most one item per CTA, which FlashInfer's plan schedules as well and for
        less host time than a kernel launch, or a planner graph of this wrapper, whose
        :meth:`replay_plan` decides instead."""
        got = self._plannable(wrapper)
        if got is None:
            return False
        graph = self._plan_graphs.get(id(wrapper))
        if not defer and graph is not None and graph[1] is got:
            # the replan asked replay_plan first, which declined this plan on the same checks
            # (the items' count against the arrays and the CTAs): not counted again
            return False
        n = item_count(lengths, heads, tile_rows(head_dim))
        if n > got[0].capacity:
            return False
        if defer:
            captured = self._captured.get(id(wrapper))
            return captured is not None and captured[0] == "plan" and captured[1] is got
        if n <= self.num_ctas:
            return False
        self._queue_plan(got, heads, head_dim, indptr)
        self.device_plans += 1
        return True

    def launch_plan(self, wrapper: Any, heads: int, head_dim: int, indptr: torch.Tensor) -> bool:
        """Capture the planner of ``wrapper``'s plans into ``full``'s graph (inside its capture,
        after the wrapper's first plan): each replay plans the live batch on the device from
        ``indptr``, and :meth:`plan` (deferred) lets the host skip FlashInfer's plan. False
        where the planner is not trusted or the plan is not an SM90 layout (nothing queued)."""
        got = self._plannable(wrapper)
        if got is None:
            return False
        self._queue_plan(got, heads, head_dim, indptr)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._captured[id(wrapper)] = ("plan", got)
        return True

    def capture_plan(
        self, wrapper: Any, heads: int, head_dim: int, indptrs: torch.Tensor, src: torch.Tensor
    ) -> bool:
        """Capture a segment backend's later plans of ``wrapper`` (a CUDA-graph ragged wrapper,
        planned once through FlashInfer, outside any capture) as one small CUDA graph: the copy
        of ``src`` (the replan's pinned host indptrs, (2, S+1) int32, rewritten before each plan)
        into ``indptrs`` (the device rows the kernels read), then the planner. Why: launched
        one by one after a segment's graph launch, the copy and the planner's Triton launch cost
        the host 260-410 us before the first attention on an H100 (docs/benchmarks.md, session
        48), with the device idle; one graph launch is a few us (:meth:`replay_plan`). False
        where the planner is not trusted, the plan is not an SM90 layout, or the capture
        failed (logged; the planner is then launched as before)."""
        got = self._plannable(wrapper)
        if got is None or self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return False
        if src.device.type != "cpu" or not src.is_pinned() or src.shape != indptrs.shape:
            raise ValueError("the planner graph copies from pinned host rows shaped as indptrs")
        # once eagerly first, so that triton has built the kernel for these slots before the
        # capture: it plans the indptrs the first plan copied (the same items, snake-dealt)
        self._queue_plan(got, heads, head_dim, indptrs[0])
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    indptrs.copy_(src, non_blocking=True)  # read from src at each replay
                    self._queue_plan(got, heads, head_dim, indptrs[0])
                finally:
                    graph.capture_end()
        except RuntimeError as exc:
            log.warning("planner graph not captured (%s); the planner is launched per plan", exc)
            return False
        finally:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self._plan_graphs[id(wrapper)] = (graph, got)
        return True

    def replay_plan(self, wrapper: Any, heads: int, head_dim: int, lengths: np.ndarray) -> bool:
        """Plan ``wrapper`` for request slots of these query ``lengths`` by replaying the graph
        :meth:`capture_plan` made of it: the indptr copy and the planner. True where it did;
        False where no graph was captured for this layout, the items exceed the arrays, or there
        is at most one item per CTA (FlashInfer's plan, as before), and the caller copies and
        plans as before."""
        kept = self._plan_graphs.get(id(wrapper))
        if kept is None:
            return False
        graph, got = kept
        if self._plannable(wrapper) is not got:
            return False
        n = item_count(lengths, heads, tile_rows(head_dim))
        # at most one item per CTA FlashInfer's plan is as short, and taking the planner there
        # put its kernel in front of the first attention for nothing: `breakable` at 256 tokens
        # ran 0.5-1.5% slower on an H100 (docs/benchmarks.md, session 48)
        if n > got[0].capacity or (n <= self.num_ctas and not self.small_plans_on_device):
            return False
        graph.replay()
        self.device_plans += 1
        return True

    def _plannable(self, wrapper: Any) -> Placed | None:
        """The layout the planner writes for ``wrapper`` (its first plan's: graph wrappers keep
        it), or None where the planner is not trusted or the plan is not an SM90 layout."""
        if not self.plans_on_device or getattr(wrapper, "_backend", None) != "fa3":
            return None
        return self._layout(wrapper, True)

    def _queue_plan(self, got: Placed, heads: int, head_dim: int, indptr: torch.Tensor) -> None:
        layout, _, region = got
        _launch_planner(layout, region, heads, head_dim, indptr, self.num_ctas)

    def _items_fit_ctas(self, got: Placed) -> bool:
        """Whether the plan in the pinned buffer has at most one item per CTA (FlashInfer's item
        count is the CTA ranges' end; the host rewrite reads it with the ranges it needs)."""
        layout, host, _ = got
        return int(host[layout.at["work_indptr"] + self.num_ctas]) <= self.num_ctas

    def launch(self, wrapper: Any, head_dim: int) -> bool:
        """Queue the device rewrite of ``wrapper``'s last plan (captured, when called inside a
        CUDA-graph capture: then every replay deals the plan made before it). False where the
        plan is not an SM90 layout (nothing queued)."""
        if not self.on_device or getattr(wrapper, "_backend", None) != "fa3":
            return False
        got = self._layout(wrapper, True)  # the plan just made, or the one the capture planned
        if got is None:
            return self._keep("the plan info is not FlashInfer's SM90 layout")
        return self._deal_on_device(wrapper, head_dim, got)

    def _deal_on_device(self, wrapper: Any, head_dim: int, got: Placed) -> bool:
        """Queue the copy of ``got``'s region and the kernel that deals it again."""
        from service.ranks.attention import sm90_triton

        layout, _, region = got
        src, tmp = self._scratch_for(wrapper, region.numel(), layout.capacity)
        src[: region.numel()].copy_(region)
        sm90_triton.deal(
            src, region, tmp, layout.capacity, layout.local("work_indptr"), layout.local("batch"),
            self.num_ctas, tile_rows(head_dim),
        )  # fmt: skip
        if torch.cuda.is_current_stream_capturing():
            self._captured[id(wrapper)] = ("deal", got)
        self.applied += 1
        return True

    def _scratch_for(
        self, wrapper: Any, length: int, capacity: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The device rewrite's buffers for ``wrapper``, kept per wrapper (a captured kernel
        reads them at every replay: they are never reallocated for a wrapper whose layout does
        not grow, which a CUDA-graph wrapper's never does) and grown for an eager one."""
        from service.ranks.attention.sm90_triton import scratch_size

        device = wrapper._int_workspace_buffer
        got = self._scratch.get(id(wrapper))
        need = scratch_size(capacity, self.num_ctas)
        if got is None or got[0] is not device or got[1].numel() < length or got[2].numel() < need:
            if id(wrapper) in self._captured and got is not None and got[0] is device:
                raise RuntimeError("a captured schedule kernel's buffers would be reallocated")
            src = torch.empty(length, dtype=torch.int32, device=self.device)
            tmp = torch.empty(need, dtype=torch.int32, device=self.device)
            got = self._scratch[id(wrapper)] = (device, src, tmp)
        return got[1], got[2]

    def planned(self, wrapper: Any, head_dim: int) -> tuple[np.ndarray, np.ndarray] | None:
        """FlashInfer's schedule of ``wrapper``'s last plan, read as the rewrite reads it (from
        the pinned buffer, which the rewrite leaves as it is): each item's cost in the
        schedule's order and the CTA ranges (None: not an SM90 layout)."""
        got = self._layout(wrapper, False)
        if got is None:
            return None
        layout, host, _ = got
        at = layout.at
        work_indptr = host[at["work_indptr"] : at["work_indptr"] + self.num_ctas + 1]
        return self._items(layout, host, int(work_indptr[-1]), head_dim)[2], work_indptr

    @staticmethod
    def _items(
        layout: Layout, host: np.ndarray, n: int, head_dim: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The plan's first ``n`` items: the (6, n) block of BLOCK_FIELDS, the batch indices,
        and each item's cost."""
        cap, start = layout.capacity, layout.start
        block = host[start : start + 6 * cap].reshape(6, cap)[:, :n]
        batch = host[layout.at["batch"] : layout.at["batch"] + n]
        return block, batch, item_costs(block[0], block[3], block[4], tile_rows(head_dim))

    def _layout(self, wrapper: Any, same_info: bool) -> Placed | None:
        """The last plan's layout, an int32 view of the wrapper's pinned schedule buffer and the
        device region the arrays span (kept per wrapper: graph wrappers plan the same layout
        every time)."""
        info = wrapper._plan_info
        pinned, device = wrapper._pin_memory_int_workspace_buffer, wrapper._int_workspace_buffer
        got = self._layouts.get(id(wrapper))
        # the buffers by identity too: a wrapper dropped with its bucket (forget) may leave its
        # id to a new wrapper, whose buffers the kept views would not be
        if (
            got is not None
            and got[1] is pinned
            and got[2] is device
            and (same_info or got[0] is info or bool(got[0] == info))
        ):
            return got[3]
        layout = Layout.of(info, self.num_ctas)
        placed = None
        if layout is not None:
            host = pinned.numpy().view(np.int32)
            region = device.view(torch.int32)[layout.start : layout.end]
            placed = (layout, host, region)
        self._layouts[id(wrapper)] = (info, pinned, device, placed)
        return placed

    def forget(self, wrapper: Any) -> None:
        """Drop what is kept for ``wrapper`` (its bucket's graphs are gone)."""
        for kept in (self._layouts, self._scratch, self._captured, self._plan_graphs):
            kept.pop(id(wrapper), None)

    def _wait(self) -> None:
        if self._pending:
            self._copied.synchronize()  # long done in steady state: a query, no wait
            self._pending = False

    def _keep(self, why: str) -> bool:
        self.kept += 1
        if self._failed is None:
            self._failed = why
            log.warning("SM90 prefill schedule kept as FlashInfer planned it: %s", why)
        return False


class LaidOutPlan:
    """A plan's int buffer laid out as FlashInfer's SM90 plan lays one out, held as a wrapper
    holds it (what the rewrite reads of a wrapper): the arrays in FIELDS order from byte 64,
    each 16-byte aligned and ``spare`` entries longer than the items, -7 in every byte no array
    owns; the pinned buffer as the plan wrote it and the int workspace on ``device`` as its copy
    left it. ``items``: (n, 7) rows of ITEM_FIELDS."""

    _backend = "fa3"

    def __init__(
        self, items: np.ndarray, work_indptr: np.ndarray, device: torch.device, spare: int = 3
    ) -> None:
        n = items.shape[0]
        at, offsets = 64, {}  # FlashInfer's allocator: in FIELDS order, 16-byte aligned
        for f in FIELDS:
            offsets[f] = at
            size = 4 * (work_indptr.shape[0] if f == "work_indptr" else n + spare)
            at = -(-(at + size) // 16) * 16
        ints = np.full(at // 4 + 32, -7, dtype=np.int32)
        for k, f in enumerate(ITEM_FIELDS):
            ints[offsets[f] // 4 : offsets[f] // 4 + n] = items[:, k]
        ints[offsets["work_indptr"] // 4 :][: work_indptr.shape[0]] = work_indptr
        self.offsets = offsets  # field -> byte offset
        self._plan_info = [*offsets.values(), 0]
        self._pin_memory_int_workspace_buffer = torch.from_numpy(ints.view(np.uint8))
        self._int_workspace_buffer = self._pin_memory_int_workspace_buffer.to(device, copy=True)


def probe_items(num_ctas: int, tiles: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """A schedule the snake shortens: one causal request of ``tiles`` query tiles on enough
    heads for three items per CTA, listed head by head from the last tile to the first (as
    FlashInfer lists them) and cut into equal runs per CTA; its items (rows of ITEM_FIELDS)
    and CTA ranges."""
    heads = -(-3 * num_ctas // tiles)
    n, length = heads * tiles, tiles * CTA_TILE_Q
    items = np.array(
        [(t, 0, 0, length, length, h, 0) for h in range(heads) for t in reversed(range(tiles))],
        dtype=np.int32,
    )
    return items, np.linspace(0, n, num_ctas + 1).astype(np.int32)


@functools.cache
def device_rewrite_error(device: torch.device, num_ctas: int) -> str | None:
    """None where the device rewrite deals a synthetic plan (:func:`probe_items`) into exactly the
    bytes the host rewrite writes, else why not (triton missing, the kernel failing to build or
    run, or other bytes). Once per device: ranks that ask for the balanced schedule check it at
    start-up and deal on the host where it fails."""
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return f"triton does not import ({type(exc).__name__}: {exc})".splitlines()[0]
    try:
        items, work_indptr = probe_items(num_ctas)
        host, dev = (LaidOutPlan(items, work_indptr, device) for _ in range(2))
        if not SM90Rebalance(device, num_ctas, on_device=False)(host, 128):
            return "the host rewrite kept the probe plan (the probe is wrong)"
        SM90Rebalance(device, num_ctas, on_device=True)(dev, 128)
        if not torch.equal(dev._int_workspace_buffer, host._int_workspace_buffer):
            return "the device rewrite dealt the probe plan otherwise than the host rewrite"
    except Exception as exc:
        return f"the device rewrite failed ({type(exc).__name__}: {exc})".splitlines()[0]
    return None


def _launch_planner(
    layout: Layout,
    region: torch.Tensor,
    heads: int,
    head_dim: int,
    indptr: torch.Tensor,
    num_ctas: int,
) -> None:
    """Queue the planner (:func:`sm90_triton.plan`) into ``region``, the device int32 view of
    ``layout``'s arrays, for the request slots in ``indptr``."""
    from service.ranks.attention import sm90_triton

    sm90_triton.plan(
        indptr, region, heads, layout.capacity, layout.local("work_indptr"),
        layout.local("batch"), num_ctas, tile_rows(head_dim),
    )  # fmt: skip


def planner_bytes(
    lengths: list[int], heads: int, num_ctas: int, device: torch.device, spare: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int workspace (int32) the planner leaves for request slots of these ``lengths`` (head
    dim 128), written into a buffer laid out as FlashInfer lays an SM90 plan (:class:`LaidOutPlan`,
    ``spare`` entries past each array's items, -7 in every entry no array owns) at the offsets
    the service reads from its plan info, and the workspace sm90_balance.planned says it must
    leave: (written, wanted), on ``device``."""
    lens = np.asarray(lengths, dtype=np.int64)
    p = planned(lens, heads, num_ctas)
    wanted = LaidOutPlan(p.rows(), p.work_indptr, device, spare)
    layout = Layout.of(wanted._plan_info, num_ctas)
    if layout is None:
        raise RuntimeError("the probe's plan info is not an SM90 layout")
    want = wanted._int_workspace_buffer.view(torch.int32)
    written = torch.full_like(want, -7)
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=device)
    _launch_planner(layout, written[layout.start : layout.end], heads, 128, indptr, num_ctas)
    return written, want


# the planner's start-up probe: slots with a sentinel, lengths on and off tile edges (equal costs
# across requests), more items than CTAs on any GPU
PROBE_LENGTHS = (2048, 0, 700, 384, 1000)


@functools.cache
def device_plan_error(device: torch.device, num_ctas: int) -> str | None:
    """None where the planner writes exactly sm90_balance.planned's schedule for the probe's
    slots (:data:`PROBE_LENGTHS`, 12 heads), else why not. Once per device."""
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return f"triton does not import ({type(exc).__name__}: {exc})".splitlines()[0]
    try:
        written, wanted = planner_bytes(list(PROBE_LENGTHS), 12, num_ctas, device)
        if not torch.equal(written, wanted):
            return "the planner wrote another schedule than the reference for the probe's slots"
    except Exception as exc:
        return f"the planner failed ({type(exc).__name__}: {exc})".splitlines()[0]
    return None


@functools.cache  # logged once per device
def _device_plan_checked(device: torch.device, num_ctas: int) -> bool:
    err = device_plan_error(device, num_ctas)
    if err is None:
        log.info(
            "SM90 prefill schedule: planned on the device from the request lengths (FlashInfer's "
            "host plan skipped where more items than CTAs; a probe planned as the reference)"
        )
    else:
        log.warning("SM90 prefill schedule: FlashInfer's host plan kept: %s", err)
    return err is None


@functools.cache  # logged once per device, however many attention backends ask
def _device_rewrite_checked(device: torch.device, num_ctas: int) -> bool:
    err = device_rewrite_error(device, num_ctas)
    if err is None:
        log.info("SM90 prefill schedule: dealt on the device (a probe plan dealt as the host does)")
    else:
        log.warning("SM90 prefill schedule: dealt on the host, not the device: %s", err)
    return err is None
