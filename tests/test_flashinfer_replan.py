"""``full`` replans FlashInfer's CUDA-graph ragged wrapper through the one module call its Python
``plan`` makes (``RaggedReplan``). The GPU test in test_flashinfer.py checks it against
FlashInfer's own plan; these pin the contract on CPU with a stand-in that plans as FlashInfer's
wrapper does (installs its module during ``plan``, copies the indptrs into the buffers the graph
reads, derives the KV lengths, calls the module), so CI covers it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from service.ranks.attention.flashinfer_replan import RaggedReplan

S = 4


class Wrapper:
    """FlashInfer's ragged wrapper in CUDA-graph mode, as far as its plan goes."""

    def __init__(self, indptrs: torch.Tensor, module_calls: int = 1) -> None:
        self._qo_indptr_buf, self._kv_indptr_buf = indptrs[0], indptrs[1]
        self.module_calls = module_calls
        self.plans = 0  # Python plans
        self.scheduled: list[tuple[list[int], list[int]]] = []  # what the module was given
        self.info = [3, 1, 4]
        self._cached_module = None
        self.module = SimpleNamespace(plan=self._module_plan)  # FlashInfer caches its modules

    def _module_plan(self, workspace, qo_host, kv_host, kv_lens, rows, batch) -> list[int]:
        assert qo_host.device.type == "cpu" and batch == S
        self.scheduled.append((qo_host.tolist(), kv_lens.tolist()))
        return list(self.info)

    def plan(self, qo: torch.Tensor, kv: torch.Tensor) -> None:
        self.plans += 1
        # installed by plan itself, as FlashInfer's does: a recorder swapped in before plan
        # would be replaced before the module is called
        self._cached_module = self.module
        qo_host, kv_host = qo.to("cpu"), kv.to("cpu")
        self._qo_indptr_buf.copy_(qo)
        self._kv_indptr_buf.copy_(kv)
        kv_lens = kv_host[1:] - kv_host[:-1]
        for _ in range(self.module_calls):
            self._plan_info = self._cached_module.plan("ws", qo_host, kv_host, kv_lens, 64, S)


def replan(module_calls: int = 1) -> tuple[RaggedReplan, Wrapper, torch.Tensor]:
    indptrs = torch.zeros(2, S + 1, dtype=torch.int32)
    w = Wrapper(indptrs, module_calls)
    return RaggedReplan(w, indptrs, lambda qo: w.plan(qo, qo)), w, indptrs


def offsets(lens: list[int]) -> list[int]:
    return [0, *np.cumsum(lens).tolist()]


def test_after_the_first_plan_only_the_module_call_is_made_with_the_new_layout():
    r, w, indptrs = replan()
    r(np.array([40, 24, 0, 0]))
    assert not r.fast and w.plans == 2  # the first plan: once to install, once recorded
    for lens in ([10, 0, 0, 0], [5, 6, 7, 8], [0, 0, 0, 0]):
        r(np.array(lens))
        assert r.fast and w.plans == 2  # FlashInfer's Python plan is not called again
        # the graph's buffers hold the new indptrs (query and KV ranges are the same) ...
        assert indptrs.tolist() == [offsets(lens)] * 2
        # ... and the module scheduled exactly this layout
        assert w.scheduled[-1] == (offsets(lens), lens)
    assert w._plan_info == w.info


@pytest.mark.parametrize("module_calls", [0, 2])
def test_a_plan_that_is_not_exactly_one_module_call_keeps_going_through_flashinfer(module_calls):
    r, w, indptrs = replan(module_calls)
    for i, lens in enumerate(([40, 24, 0, 0], [10, 0, 0, 0], [1, 2, 3, 4])):
        r(np.array(lens))
        assert not r.fast
        assert w.plans == 2 + i  # the recorded first plan, then one Python plan each
        assert indptrs.tolist() == [offsets(lens)] * 2


def test_a_changed_plan_info_stops_the_replay_instead_of_running_a_stale_graph():
    r, w, _ = replan()
    r(np.array([40, 24, 0, 0]))
    w.info = [3, 1, 5]  # the schedule's layout in the workspace moved: the graph is invalid
    with pytest.raises(RuntimeError, match="plan info changed"):
        r(np.array([10, 0, 0, 0]))


def test_a_replan_waits_for_the_previous_upload_before_rewriting_its_host_buffer():
    """One pinned host buffer serves every plan, and its upload is asynchronous on CUDA: a
    replan must wait for the previous plan's upload to finish before it writes the next layout
    there (else the device could read a half-written indptr). Stand-in event on CPU: when the
    wait happens, the buffer must still hold the previous layout."""
    r, _, _ = replan()

    class Event:
        def __init__(self):
            self.seen: list[list[int]] = []
            self.recorded = 0

        def record(self):
            self.recorded += 1

        def synchronize(self):
            self.seen.append(r._both[0].tolist())  # what the pending upload reads

    r._copied = event = Event()
    layouts = ([40, 24, 0, 0], [10, 0, 0, 0], [5, 6, 7, 8])
    for lens in layouts:
        r(np.array(lens))
    # every plan after the first waited, and found the previous plan's layout intact
    assert event.seen == [offsets(layouts[0]), offsets(layouts[1])]
    assert event.recorded == 3  # each plan's upload is marked


def test_a_replan_waits_for_the_previous_schedule_upload_too():
    """FlashInfer's module plan writes the schedule into the wrapper's own pinned buffer and
    queues its upload, after our indptr upload. The next plan rewrites that buffer as well, so
    the event a replan waits on must be recorded after the module call: recorded before it, the
    wait could return with the previous schedule's upload still queued, and the device would
    read the next batch's schedule for the previous forward."""
    r, w, _ = replan()

    class Event:
        def __init__(self):
            self.after_module_calls: list[int] = []

        def record(self):
            self.after_module_calls.append(len(w.scheduled))

        def synchronize(self):
            pass

    r._copied = event = Event()
    r(np.array([40, 24, 0, 0]))  # the first plan: FlashInfer's, twice (install, then record)
    for lens in ([10, 0, 0, 0], [5, 6, 7, 8]):
        r(np.array(lens))
        assert r.fast
    # each mark came after that plan's module call(s): 2 for the first, then one each
    assert event.after_module_calls == [2, 3, 4]


def test_a_plan_made_on_the_device_skips_the_module_call_after_the_indptr_copy():
    """With a device planner (sm90_schedule's, FA3's schedule written from the indptrs the
    graph reads): a later plan it takes makes no module call, yet the graph's buffers hold the
    new indptrs, the planner saw this batch's lengths, and the plan info stays the first plan's;
    a plan it declines goes through the module call as before. The first plan always goes
    through FlashInfer (it lays out the workspace the planner writes into)."""
    indptrs = torch.zeros(2, S + 1, dtype=torch.int32)
    w = Wrapper(indptrs)
    asked: list[list[int]] = []

    def device_plan(lengths: np.ndarray) -> bool:
        # the buffers it reads are already this batch's when it is asked
        assert indptrs.tolist() == [offsets(lengths.tolist())] * 2
        asked.append(lengths.tolist())
        return int(lengths.sum()) > 32  # stands in for "more items than CTAs"

    r = RaggedReplan(w, indptrs, lambda qo: w.plan(qo, qo), device_plan=device_plan)
    r(np.array([40, 24, 0, 0]))
    assert asked == [] and len(w.scheduled) == 2  # the first plan: FlashInfer's, recorded
    r(np.array([30, 20, 10, 0]))
    assert r.fast and asked == [[30, 20, 10, 0]] and len(w.scheduled) == 2
    assert indptrs.tolist() == [offsets([30, 20, 10, 0])] * 2 and w._plan_info == w.info
    r(np.array([8, 8, 0, 0]))  # declined: FlashInfer's module schedules it
    assert r.fast and len(w.scheduled) == 3
    assert w.scheduled[-1] == (offsets([8, 8, 0, 0]), [8, 8, 0, 0])


def test_a_plan_replayed_as_one_graph_copies_nothing_itself_and_waits_before_the_next():
    """A segment backend's plan replayed as one graph (sm90_schedule's replay_plan: the copy of
    the replan's host indptrs and the planner): the replan makes neither its own copy nor the
    module call nor the per-plan planner launch, yet the host rows the graph copies from hold
    this batch's layout when it is asked, and the next plan waits on the mark recorded after
    it (the graph reads those rows when it runs). A declined plan copies and plans as before."""
    indptrs = torch.zeros(2, S + 1, dtype=torch.int32)
    w = Wrapper(indptrs)
    asked: list[list[int]] = []
    launched: list[list[int]] = []

    def graph_plan(lengths: np.ndarray) -> bool:
        # what the captured copy will read: this batch's rows, in the replan's own host buffer
        assert r.host_indptrs.tolist() == [offsets(lengths.tolist())] * 2
        asked.append(lengths.tolist())
        return int(lengths.sum()) <= 64  # stands in for "the items fit the arrays"

    def device_plan(lengths: np.ndarray) -> bool:
        launched.append(lengths.tolist())
        return False

    r = RaggedReplan(w, indptrs, lambda qo: w.plan(qo, qo), device_plan=device_plan,
                     graph_plan=graph_plan)  # fmt: skip

    class Event:
        def __init__(self):
            self.recorded = self.waits = 0

        def record(self):
            self.recorded += 1

        def synchronize(self):
            self.waits += 1

    r._copied = event = Event()
    r(np.array([40, 24, 0, 0]))  # the first plan: FlashInfer's, recorded
    assert asked == [] and len(w.scheduled) == 2
    before = indptrs.clone()
    r(np.array([30, 20, 10, 0]))
    assert r.fast and asked == [[30, 20, 10, 0]] and launched == []
    assert len(w.scheduled) == 2  # no module call
    assert torch.equal(indptrs, before)  # no copy of the replan's own: the graph makes it
    assert event.recorded == 2 and w._plan_info == w.info
    r(np.array([50, 40, 0, 0]))  # declined (too many items): copied, launched, module call
    assert r.fast and asked[-1] == [50, 40, 0, 0] and launched == [[50, 40, 0, 0]]
    assert indptrs.tolist() == [offsets([50, 40, 0, 0])] * 2 and len(w.scheduled) == 3
    assert event.waits == 2  # each later plan waited for the previous one's reads


def test_a_plan_no_hook_acts_on_asks_none_of_them_and_is_planned_by_flashinfers_module():
    """Where the schedule's check says none of its hooks acts on a plan (at most an item per
    CTA: FlashInfer's schedule kept as made), the replan asks neither the planner graph nor the
    planner nor the look after the plan, and the module schedules it; a plan the check passes
    asks them as before."""
    indptrs = torch.zeros(2, S + 1, dtype=torch.int32)
    w = Wrapper(indptrs)
    asked: list[str] = []

    def hook(name: str, answer: bool):
        def call(*args: object) -> bool:
            asked.append(name)
            return answer

        return call

    r = RaggedReplan(
        w, indptrs, lambda qo: w.plan(qo, qo), after=hook("after", False),
        device_plan=hook("device_plan", False), graph_plan=hook("graph_plan", False),
        hooks_act=lambda lengths: int(lengths.sum()) > 32,  # stands in for "more items than CTAs"
    )  # fmt: skip
    r(np.array([40, 24, 0, 0]))  # the first plan: FlashInfer's, then the look after it
    assert asked == ["after"] and len(w.scheduled) == 2
    asked.clear()
    r(np.array([8, 8, 0, 0]))
    assert r.fast and asked == [] and len(w.scheduled) == 3
    assert indptrs.tolist() == [offsets([8, 8, 0, 0])] * 2 and w._plan_info == w.info
    r(np.array([30, 20, 10, 0]))  # the check passes: every hook asked, in order
    assert r.fast and asked == ["graph_plan", "device_plan", "after"] and len(w.scheduled) == 4


class _GraphWrapper:
    """What FlashInferGraphAttention asks of a CUDA-graph ragged wrapper before any plan."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.kwargs = kwargs

    def reset_workspace_buffer(self, *args: object) -> None:
        pass


def test_a_balanced_segment_bucket_that_cannot_need_the_schedule_replans_as_flashinfer_does():
    """The balanced schedule's replans of a segment backend: a bucket whose plans can never have
    more items than CTAs (256 tokens over 8 slots, 12 heads: at most 108 of 132) gets no work
    after its plans (the replan FlashInfer's schedule would get); 2,048 tokens gets the
    schedule's pass after each plan; ``full``'s (deferred) replans keep it at every bucket,
    since its graph holds the kernel."""
    from service.ranks.attention.flashinfer_backend import (
        FlashInferGraphAttention,
        GraphPlanBuffers,
        HeadShape,
    )
    from service.ranks.attention.sm90_schedule import SM90Rebalance

    def attention(defer: bool) -> FlashInferGraphAttention:
        # the object without its constructor (which imports FlashInfer): the fields _replan reads
        a = object.__new__(FlashInferGraphAttention)
        a.fi = SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=_GraphWrapper)
        a.workspace, a.kernel, a.dtype = torch.zeros(8, dtype=torch.uint8), "fa3", torch.bfloat16
        a.balance = SM90Rebalance(torch.device("cpu"), num_ctas=132)
        a._defer, a._wrappers, a._replans = defer, {}, {}
        return a

    shape = HeadShape(12, 2, 128, 128**-0.5)
    bufs = GraphPlanBuffers.allocate(8, 2048, torch.device("cpu"))
    segment = attention(defer=False)
    assert segment._replan(256, shape, bufs)._after is None
    at_2048 = segment._replan(2048, shape, bufs)
    assert at_2048._after is not None
    # each plan checked first: one request of 1,024 tokens is 96 items (none acts), 2,048 is 192
    assert not at_2048._hooks_act(np.array([1024, 0, 0, 0, 0, 0, 0, 0]))
    assert at_2048._hooks_act(np.array([2048, 0, 0, 0, 0, 0, 0, 0]))
    assert segment.balance.kept == 1  # the plan no hook acts on counts as kept, as before
    segment.balance.small_plans_on_device = True  # then the planner graph takes small plans too
    assert at_2048._hooks_act(np.array([1024, 0, 0, 0, 0, 0, 0, 0]))
    full = attention(defer=True)
    assert full._replan(256, shape, bufs)._after is not None
    assert full._replan(2048, shape, bufs)._hooks_act is None  # its graph deals every plan
