"""The SM90 prefill schedule policy (pure numpy): FlashInfer's items dealt longest first.

FlashInfer's own assignment is rebuilt here from its source (scheduler.cuh, PrefillSM90Plan:
heads outer, requests by KV length, query tiles last to first, each to the least-loaded CTA)
so the tests compare against the schedule the kernel would otherwise run."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.ranks.attention.sm90_balance import item_costs, makespan, rebalanced, snake

H100_SMS = 132


def flashinfer_plan(lens: list[int], heads: int, ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """Item costs in the order FlashInfer's schedule lists them (by CTA), and its CTA ranges."""
    tiles, qo = [], []
    for _ in range(heads):
        for n in sorted(lens, reverse=True):  # by KV length, longest first (prefill: KV = Q)
            for t in reversed(range(-(-n // 128))):
                tiles.append(t)
                qo.append(n)
    costs = item_costs(np.array(tiles), np.array(qo), np.array(qo))
    load = [(0, c) for c in range(ctas)]
    cta = []
    for c in costs:
        got, i = heapq.heappop(load)
        heapq.heappush(load, (got + int(c), i))
        cta.append(i)
    by_cta = np.argsort(np.array(cta), kind="stable")
    work_indptr = np.zeros(ctas + 1, dtype=np.int64)
    work_indptr[1:] = np.cumsum(np.bincount(np.array(cta), minlength=ctas))
    return costs[by_cta], work_indptr


def test_one_long_sequence_finishes_with_its_longest_tile():
    """2,048 tokens, 12 heads, 132 SMs: FlashInfer's busiest CTA holds 3,328 KV rows of work
    (the cost model's units); dealt again, 2,304, the last tile's own cost, which no schedule
    can beat."""
    costs, wi = flashinfer_plan([2048], 12, H100_SMS)
    assert makespan(costs, wi) == 3328
    ours = rebalanced(costs, wi)
    assert ours is not None
    assert makespan(costs[ours.order], ours.work_indptr) == int(costs.max()) == 2304


def test_as_many_items_as_ctas_keeps_the_plan():
    costs, wi = flashinfer_plan([1024], 12, H100_SMS)  # 96 items: one CTA each
    assert rebalanced(costs, wi) is None


def test_the_causal_cost_counts_the_prefix():
    """A query tile attends over the KV rows up to its last row (right-aligned: a cached prefix
    comes first); the last tile over all of them."""
    got = item_costs(
        np.array([0, 1, 2, 0]), np.array([300, 300, 300, 50]), np.array([300, 300, 300, 1050])
    )
    assert got.tolist() == [256 + 128, 256 + 256, 256 + 300, 256 + 1050]


@settings(max_examples=200, deadline=None)
@given(
    lens=st.lists(st.integers(1, 9000), min_size=1, max_size=12),
    heads=st.sampled_from([1, 2, 12, 16, 28]),
    ctas=st.sampled_from([8, 78, 132]),
)
def test_every_item_runs_once_and_the_busiest_cta_never_gets_busier(lens, heads, ctas):
    costs, wi = flashinfer_plan(lens, heads, ctas)
    ours = rebalanced(costs, wi)
    if ours is None:
        return
    assert sorted(ours.order.tolist()) == list(range(costs.shape[0]))
    assert ours.work_indptr[0] == 0 and ours.work_indptr[-1] == costs.shape[0]
    assert np.all(np.diff(ours.work_indptr) >= 0)
    mine = makespan(costs[ours.order], ours.work_indptr)
    assert mine < makespan(costs, wi)
    # the snake is within one item of the average load plus the longest item (list scheduling's
    # bound: a CTA's last item started no later than the average)
    assert mine <= costs.sum() / ctas + costs.max()


@given(costs=st.lists(st.integers(1, 10_000), min_size=0, max_size=400), ctas=st.integers(1, 140))
def test_the_snake_deals_each_cta_one_item_a_round(costs, ctas):
    c = np.array(costs, dtype=np.int64)
    s = snake(c, ctas)
    counts = np.diff(s.work_indptr)
    assert counts.max() - counts.min() <= 1
    assert sorted(s.order.tolist()) == list(range(len(costs)))
    for i in range(ctas):  # each CTA's items longest first
        mine = c[s.order[s.work_indptr[i] : s.work_indptr[i + 1]]]
        assert np.all(np.diff(mine) <= 0)


def test_the_schedule_is_balanced_where_fa3_runs_and_says_why_elsewhere():
    from service.errors import ConfigError
    from service.ranks.select import choose_prefill_schedule as choose

    assert choose("auto", "flashinfer", "auto", (9, 0), mla=False).name == "balanced"
    assert choose("auto", "flashinfer", "fa3", (9, 0), mla=False).name == "balanced"
    why = {
        "torch attention": choose("auto", "torch", "auto", (9, 0), mla=False),
        "FA2": choose("auto", "flashinfer", "fa2", (9, 0), mla=False),
        "Blackwell": choose("auto", "flashinfer", "auto", (10, 0), mla=False),
        "CPU": choose("auto", "torch", "auto", None, mla=False),
        "MLA": choose("auto", "flashinfer", "auto", (9, 0), mla=True),
    }
    assert {c.name for c in why.values()} == {"own"}
    assert (
        "torch's" in why["torch attention"].reason
        and "--flashinfer-kernel fa2" in why["FA2"].reason
    )
    assert "sm100" in why["Blackwell"].reason and "MLA" in why["MLA"].reason
    assert (
        choose("own", "flashinfer", "auto", (9, 0), mla=False).reason
        == "asked for (--prefill-schedule own)"
    )
    with pytest.raises(ConfigError, match=r"--prefill-schedule balanced cannot run here: .*FA2"):
        choose("balanced", "flashinfer", "fa2", (9, 0), mla=False)


def test_server_info_reports_the_schedule_and_why():
    """The built-in model on CPU: torch attention, so FlashInfer's schedule is not in play."""
    from service.config import EngineConfig, GraphConfig
    from service.engine import Engine

    e = Engine(EngineConfig(device="cpu", graph=GraphConfig(backend="eager")))
    try:
        got = e.resolved.to_json()["prefill_schedule"]
    finally:
        e.shutdown()
    assert got == {
        "name": "own",
        "reason": "auto: prefill attention is torch's, not FlashInfer's FA3",
    }
