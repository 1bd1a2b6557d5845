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

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from service.ranks.attention.sm90_balance import item_costs, rebalanced, tile_rows

log = logging.getLogger(__name__)

# PrefillPlanSM90Info::ToVector: byte offsets into the int workspace, then a flag
FIELDS = ("tile", "qo_indptr", "kv_indptr", "qo_len", "kv_len", "head", "work_indptr", "batch")
ITEM_FIELDS = tuple(f for f in FIELDS if f != "work_indptr")


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
        return Layout(at=at, capacity=capacity, start=at["tile"], end=end)


class SM90Rebalance:
    """Rewrites the SM90 schedule of FlashInfer prefill wrappers that share one int workspace
    on ``device``, after each of their plans. One pinned staging buffer serves them all: only
    one plan is in flight at a time, and its copy is waited for before the next overwrites it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.num_ctas = torch.cuda.get_device_properties(device).multi_processor_count
        # id(wrapper) -> (plan info, (layout, pinned buffer's view) or None)
        self._layouts: dict[int, tuple[Any, tuple[Layout, np.ndarray] | None]] = {}
        self._stage = torch.empty(0, dtype=torch.int32)
        self._copied = torch.cuda.Event()
        self._pending = False
        self._failed: str | None = None  # the first failed check, logged once
        self.applied = 0  # plans whose schedule was rewritten
        self.kept = 0  # plans whose schedule was already as short (or checks failed)

    def __call__(self, wrapper: Any, head_dim: int) -> bool:
        """Deal ``wrapper``'s last plan again if that shortens its busiest CTA; True if done."""
        if getattr(wrapper, "_backend", None) != "fa3":
            return False
        got = self._layout(wrapper)
        if got is None:
            return self._keep("the plan info is not FlashInfer's SM90 layout")
        layout, host = got
        at = layout.at
        work_indptr = host[at["work_indptr"] : at["work_indptr"] + self.num_ctas + 1]
        n = int(work_indptr[-1])
        if n <= self.num_ctas:  # an item per CTA at most, in either schedule: nothing to gain
            self.kept += 1
            return False
        if work_indptr[0] != 0 or n > layout.capacity or np.any(np.diff(work_indptr) < 0):
            return self._keep(f"the CTA ranges {work_indptr[[0, -1]]} do not span the items")
        items = {f: host[at[f] : at[f] + n] for f in ITEM_FIELDS}
        costs = item_costs(items["tile"], items["qo_len"], items["kv_len"], tile_rows(head_dim))
        schedule = rebalanced(costs, work_indptr.astype(np.int64))
        if schedule is None:
            self.kept += 1
            return False
        self._wait()
        if self._stage.numel() < layout.end - layout.start:
            self._stage = torch.empty(layout.end - layout.start, dtype=torch.int32, pin_memory=True)
        length = layout.end - layout.start
        stage = self._stage.numpy()
        stage[:length] = host[layout.start : layout.end]  # what lies between the arrays too
        for f in ITEM_FIELDS:
            i = at[f] - layout.start
            stage[i : i + n] = items[f][schedule.order]
        i = at["work_indptr"] - layout.start
        stage[i : i + self.num_ctas + 1] = schedule.work_indptr
        # FlashInfer's copy of the same region is queued before this one on the same stream, so
        # ours lands last
        region = wrapper._int_workspace_buffer.view(torch.int32)[layout.start : layout.end]
        region.copy_(self._stage[:length], non_blocking=True)
        self._copied.record()
        self._pending = True
        self.applied += 1
        return True

    def _layout(self, wrapper: Any) -> tuple[Layout, np.ndarray] | None:
        """The last plan's layout and an int32 view of the wrapper's pinned schedule buffer
        (kept per wrapper: graph wrappers plan the same layout every time)."""
        info = wrapper._plan_info
        got = self._layouts.get(id(wrapper))
        if got is not None and (got[0] is info or bool(got[0] == info)):
            return got[1]
        layout = Layout.of(info, self.num_ctas)
        host = wrapper._pin_memory_int_workspace_buffer.numpy().view(np.int32)
        made = None if layout is None else (layout, host)
        self._layouts[id(wrapper)] = (info, made)
        return made

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
