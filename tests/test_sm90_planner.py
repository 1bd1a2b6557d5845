"""FA3's prefill schedule made from the request lengths alone (sm90_balance.planned, which the
device planner sm90_triton.plan writes array for array: benchmarks/sm90_interpret.py checks the
kernel against it under Triton's interpreter, tests/test_sm90_schedule.py on the GPU), and when
SM90Rebalance.plan lets it replace FlashInfer's host plan. CPU only: the planner's kernel is
stood in for by the reference it is checked against, so these pin the schedule's contract and
the decisions and offsets around the launch."""

from __future__ import annotations

import random
import sys
import types

import numpy as np
import pytest
import torch

from service.ranks.attention.sm90_balance import item_costs, item_count, makespan, planned
from tests.test_sm90_balance import H100_SMS, device_schedule, fake_wrapper, flashinfer_items


def _random_slots(rng: random.Random) -> list[int]:
    lens = [rng.choice([0, rng.randrange(1, 129), rng.randrange(1, 4097)]) for _ in range(6)]
    return lens[: rng.randrange(1, 7)]


@pytest.mark.parametrize(
    "lens", [[2048], [1000, 700, 348], [2048, 0, 700, 384, 1000], [128, 256, 0, 0], [1, 4096]]
)
def test_the_planned_schedule_runs_flashinfers_items_no_longer_than_its_heap(lens):
    """The attention computes the same thing whichever schedule it reads: the planned items are
    FlashInfer's, each once (tile, ranges, lengths, head and request), and the busiest CTA is
    never busier than under FlashInfer's heap for these layouts."""
    heads = 12
    ours = planned(np.array(lens), heads, H100_SMS)
    theirs, their_wi = flashinfer_items(lens, heads, H100_SMS)
    assert ours.block.shape[1] == item_count(np.array(lens), heads) == len(theirs)
    assert sorted(map(tuple, ours.rows().tolist())) == sorted(map(tuple, theirs.tolist()))
    mine = makespan(item_costs(ours.block[0], ours.block[3], ours.block[4]), ours.work_indptr)
    heap = makespan(item_costs(theirs[:, 0], theirs[:, 3], theirs[:, 4]), their_wi)
    assert mine <= heap


def test_random_slots_plan_every_item_once_within_the_list_scheduling_bound():
    """Random slot layouts (sentinels, lengths on and off tile edges), heads and CTA counts: the
    items are FlashInfer's, the CTA ranges cover them in order with counts at most one apart
    (the snake's), and the busiest CTA is within the greedy bound (mean load plus the longest
    item), which a schedule that dropped, repeated or piled up items would break."""
    rng = random.Random(47)
    for _ in range(150):
        lens, heads, ctas = _random_slots(rng), rng.choice([1, 2, 12, 16]), rng.choice([78, 132])
        ours = planned(np.array(lens), heads, ctas)
        theirs, _ = flashinfer_items(lens, heads, ctas)
        assert sorted(map(tuple, ours.rows().tolist())) == sorted(map(tuple, theirs.tolist()))
        wi = ours.work_indptr
        assert wi[0] == 0 and wi[-1] == len(theirs) and len(wi) == ctas + 1
        assert np.ptp(np.diff(wi)) <= 1, (lens, heads, ctas)
        costs = item_costs(ours.block[0], ours.block[3], ours.block[4])
        if len(costs):
            assert makespan(costs, wi) <= costs.sum() / ctas + costs.max(), (lens, heads)


class _Planner:
    """sm90_triton.plan as its reference writes it (the kernel is checked against the same
    reference elsewhere): reads the slots from ``indptr``, writes the region at the offsets it
    is given."""

    def __init__(self) -> None:
        self.launches = 0

    def plan(self, indptr, dst, heads, capacity, wi_at, batch_at, num_ctas, rows) -> None:
        self.launches += 1
        lens = np.diff(indptr.numpy().astype(np.int64))
        n = item_count(lens, heads, rows)
        if n > capacity:
            return
        p = planned(lens, heads, num_ctas, rows)
        for f in range(6):
            dst[f * capacity : f * capacity + n] = torch.tensor(p.block[f])
        dst[batch_at : batch_at + n] = torch.tensor(p.batch)
        dst[wi_at : wi_at + num_ctas + 1] = torch.tensor(p.work_indptr)


@pytest.fixture
def planner(monkeypatch) -> _Planner:
    got = _Planner()
    fake = types.ModuleType("service.ranks.attention.sm90_triton")
    fake.plan = got.plan
    monkeypatch.setitem(sys.modules, "service.ranks.attention.sm90_triton", fake)
    monkeypatch.setattr(sys.modules["service.ranks.attention"], "sm90_triton", fake, raising=False)
    return got


def _trusted():
    from service.ranks.attention.sm90_schedule import SM90Rebalance

    balance = SM90Rebalance(torch.device("cpu"), num_ctas=H100_SMS)
    assert not balance.plans_on_device  # never without CUDA and a probe that passed
    balance.plans_on_device = True  # as the probe sets it on a GPU
    return balance


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)


def _check_plans(w, balance, cases, plan) -> None:
    """For each (lengths, taken): ``plan(lengths)`` says whether the device planned them; where
    it did, the arrays the attention reads hold the reference's plan of those slots, and where
    it did not, nothing was written."""
    for lens, taken in cases:
        before = w._int_workspace_buffer.clone()
        assert plan(lens) == taken, lens
        if not taken:
            assert torch.equal(w._int_workspace_buffer, before), lens
            continue
        ours, wi = device_schedule(w, balance)
        want = planned(np.array(lens), 12, H100_SMS)
        assert np.array_equal(ours, want.rows()) and np.array_equal(wi, want.work_indptr), lens


def test_the_planner_replaces_flashinfers_plan_only_where_more_items_than_ctas(planner):
    """A wrapper planned once through FlashInfer (its capture's plan, [2048]); later batches
    planned on the device where they hold more items than CTAs: the arrays the attention reads
    then hold the planned schedule of the new slots, and FlashInfer's pinned buffer (its last
    host plan) is left alone; at most one item per CTA, or more items than the arrays hold,
    FlashInfer plans (nothing launched, nothing written)."""
    theirs, their_wi = flashinfer_items([2048], 12, H100_SMS)
    w = fake_wrapper(theirs, their_wi, spare=300)  # graph wrappers' arrays hold the largest batch
    balance = _trusted()
    pinned = w._pin_memory_int_workspace_buffer.clone()
    cases = (([1000, 700, 348], True), ([1024, 0, 0], False), ([4096, 2048, 0], False),
             ([1500, 0, 500], True))  # fmt: skip
    _check_plans(w, balance, cases,
                 lambda lens: balance.plan(w, 12, 128, _indptr(lens), np.array(lens)))  # fmt: skip
    assert balance.device_plans == planner.launches == 2
    assert torch.equal(w._pin_memory_int_workspace_buffer, pinned)


def test_a_deferred_plan_is_skipped_only_where_the_graph_holds_the_planner(planner):
    """``full``: the host skips FlashInfer's plan (deferred) only where the captured graph
    replays the planner for this wrapper's layout; a graph holding the deal kernel (it deals
    the host plan again) or none at all needs FlashInfer's plan, and nothing is launched at
    plan time either way."""
    theirs, their_wi = flashinfer_items([2048], 12, H100_SMS)
    w = fake_wrapper(theirs, their_wi, spare=300)
    balance = _trusted()
    lens = np.array([16, 0, 0])  # fewer items than CTAs: the graph's planner plans it anyway
    assert not balance.plan(w, 12, 128, _indptr([16, 0, 0]), lens, defer=True)
    got = balance._layout(w, True)
    balance._captured[id(w)] = ("deal", got)
    assert not balance.plan(w, 12, 128, _indptr([16, 0, 0]), lens, defer=True)
    balance._captured[id(w)] = ("plan", got)
    assert balance.plan(w, 12, 128, _indptr([16, 0, 0]), lens, defer=True)
    assert planner.launches == 0 and balance.device_plans == 0
    # launch_plan (what the capture records) queues it with the offsets of this layout
    assert balance.launch_plan(w, 12, 128, _indptr([1000, 700, 348]))
    ours, _ = device_schedule(w, balance)
    want = planned(np.array([1000, 700, 348]), 12, H100_SMS)
    assert np.array_equal(ours, want.rows()) and planner.launches == 1


def test_an_untrusted_planner_or_another_backend_leaves_planning_to_flashinfer(planner):
    theirs, their_wi = flashinfer_items([2048], 12, H100_SMS)
    w = fake_wrapper(theirs, their_wi)
    balance = _trusted()
    balance.plans_on_device = False
    lens = [1000, 700, 348]
    assert not balance.plan(w, 12, 128, _indptr(lens), np.array(lens))
    assert not balance.launch_plan(w, 12, 128, _indptr(lens))
    balance.plans_on_device = True
    w._backend = "fa2"
    assert not balance.plan(w, 12, 128, _indptr(lens), np.array(lens))
    assert planner.launches == 0


def test_a_replayed_planner_graph_plans_every_batch_that_fits_the_arrays(planner):
    """A segment backend's plans replayed as one captured graph (capture_plan: the replan's
    indptr copy, then the planner): taken where a plan has more items than CTAs, as the
    launched planner is; never at one item per CTA (FlashInfer plans it as well, and the
    planner's kernel would only delay the first attention), where the items exceed the arrays
    or where no graph was captured for the wrapper's present layout; never captured off CUDA.
    The stand-in graph replays what capture_plan records: the copy, then the planner."""
    theirs, their_wi = flashinfer_items([2048], 12, H100_SMS)
    w = fake_wrapper(theirs, their_wi, spare=300)
    balance = _trusted()
    indptrs = torch.zeros(2, 4, dtype=torch.int32)
    src = torch.zeros(2, 4, dtype=torch.int32)
    assert not balance.capture_plan(w, 12, 128, indptrs, src)  # CPU: no graph
    assert not balance.replay_plan(w, 12, 128, np.array([1000, 700, 348]))  # none captured
    got = balance._layout(w, True)

    class Graph:
        def replay(self) -> None:
            indptrs.copy_(src)
            balance._queue_plan(got, 12, 128, indptrs[0])

    balance._plan_graphs[id(w)] = (Graph(), got)

    def replay(lens: list[int]) -> bool:
        src[:] = _indptr(lens)  # the replan writes its host rows before asking
        return balance.replay_plan(w, 12, 128, np.array(lens))

    cases = (([1000, 700, 348], True), ([16, 0, 0], False), ([4096, 2048, 0], False),
             ([1500, 0, 500], True))  # fmt: skip
    _check_plans(w, balance, cases, replay)
    assert balance.device_plans == planner.launches == 2
    # with the graph there, the launched planner (asked after replay_plan declined) declines too
    assert not balance.plan(w, 12, 128, _indptr([1000, 700, 348]), np.array([1000, 700, 348]))
    assert planner.launches == 2
    w._int_workspace_buffer = w._int_workspace_buffer.clone()  # another layout's buffers
    assert not balance.replay_plan(w, 12, 128, np.array([1000, 700, 348]))
    balance.forget(w)
    assert id(w) not in balance._plan_graphs
