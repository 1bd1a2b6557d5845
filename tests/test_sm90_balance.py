"""The SM90 prefill schedule policy (pure numpy): FlashInfer's items dealt longest first.

FlashInfer's own assignment is rebuilt here from its source (scheduler.cuh, PrefillSM90Plan:
heads outer, requests by KV length, query tiles last to first, each to the least-loaded CTA)
so the tests compare against the schedule the kernel would otherwise run."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from service.ranks.attention.sm90_balance import (
    item_costs,
    item_count,
    makespan,
    max_item_count,
    rebalanced,
    snake,
    tile_rows,
)

H100_SMS = 132


def flashinfer_items(lens: list[int], heads: int, ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """FlashInfer's schedule of a prefill without a cached prefix: its items by CTA, as rows of
    (tile, qo_indptr, kv_indptr, qo_len, kv_len, head, batch) (sm90_schedule.ITEM_FIELDS), and
    its CTA ranges."""
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    rows = []
    for h in range(heads):
        for i in sorted(range(len(lens)), key=lambda i: -lens[i]):  # by KV length (= Q here)
            for t in reversed(range(-(-lens[i] // 128))):
                rows.append((t, starts[i], starts[i], lens[i], lens[i], h, i))
    items = np.array(rows, dtype=np.int64).reshape(-1, 7)
    costs = item_costs(items[:, 0], items[:, 3], items[:, 4])
    load = [(0, c) for c in range(ctas)]
    cta = []
    for c in costs:
        got, i = heapq.heappop(load)
        heapq.heappush(load, (got + int(c), i))
        cta.append(i)
    by_cta = np.argsort(np.array(cta), kind="stable")
    work_indptr = np.zeros(ctas + 1, dtype=np.int64)
    work_indptr[1:] = np.cumsum(np.bincount(np.array(cta, dtype=np.int64), minlength=ctas))
    return items[by_cta], work_indptr


def flashinfer_plan(lens: list[int], heads: int, ctas: int) -> tuple[np.ndarray, np.ndarray]:
    """Item costs in the order FlashInfer's schedule lists them (by CTA), and its CTA ranges."""
    items, work_indptr = flashinfer_items(lens, heads, ctas)
    return item_costs(items[:, 0], items[:, 3], items[:, 4]), work_indptr


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


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 8192), st.integers(1, 16), st.sampled_from([1, 12, 16]),
    st.sampled_from([128, 192]), st.data(),
)  # fmt: skip
def test_no_batch_of_a_bucket_has_more_items_than_its_bound_and_one_batch_has_that_many(
    tokens, slots, heads, rows, data
):
    """The bound that lets a small bucket skip the schedule's work: a wrong one (too low) would
    leave a plan with more items than CTAs in FlashInfer's schedule, one that is too high would
    keep the host work for buckets that never need it."""
    # any slots' lengths (sentinels 0) summing to at most the bucket: gaps between sorted cuts
    cuts = sorted(data.draw(st.lists(st.integers(0, tokens), min_size=slots, max_size=slots)))
    lengths = np.diff([0, *cuts])
    bound = max_item_count(tokens, slots, heads, rows)
    assert item_count(lengths, heads, rows) <= bound
    filled = min(slots, tokens)  # the batch that attains it: single rows, the rest in one
    worst = np.array([1] * (filled - 1) + [tokens - filled + 1])
    assert item_count(worst, heads, rows) == bound


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4096), min_size=1, max_size=16), st.sampled_from([1, 12, 16]),
    st.sampled_from([64, 128]), st.sampled_from([78, 132]), st.booleans(),
)  # fmt: skip
def test_a_replan_asks_the_hooks_exactly_for_plans_with_more_items_than_ctas(
    lengths, heads, head_dim, ctas, small_on_device
):
    """The per-plan check against FlashInfer's item count (one item per query tile, per
    request, per head; numpy here, plain Python in the service): one that said no to a plan with
    more items than CTAs would leave it undealt, one that said yes to a smaller one would pay
    the hooks for nothing; small plans on the device (the planner graph takes them too) always
    ask."""
    from service.ranks.attention.sm90_schedule import SM90Rebalance

    balance = SM90Rebalance(torch.device("cpu"), num_ctas=ctas)
    balance.small_plans_on_device = small_on_device
    lens = np.array(lengths, dtype=np.int64)
    items = heads * int(np.ceil(lens / tile_rows(head_dim)).sum())
    want = small_on_device or items > ctas
    assert balance.may_deal_plan(heads, head_dim, lens) == want
    assert balance.kept == (0 if want else 1)


def test_a_rank_skips_the_schedule_only_for_buckets_that_cannot_need_it():
    """Qwen2.5-1.5B's 12 heads over 8 slots on 132 SMs: up to 512 tokens a plan has at most 132
    items (an item per CTA: FlashInfer's schedule stands), from 1,024 up some batch has more.
    Head dim 64 tiles 192 rows, so its buckets reach further."""
    from service.ranks.attention.sm90_schedule import SM90Rebalance

    balance = SM90Rebalance(torch.device("cpu"), num_ctas=132)
    assert [b for b in (16, 64, 256, 512, 1024, 2048) if balance.may_deal(b, 8, 12, 128)] == [
        1024,
        2048,
    ]
    assert not balance.may_deal(768, 8, 12, 64) and balance.may_deal(1024, 8, 12, 64)
    assert balance.may_deal(16, 16, 12, 128)  # 16 single-row requests: 192 items


def test_auto_deals_fa3s_schedule_again_for_the_graph_backends_and_says_why():
    from service.errors import ConfigError
    from service.ranks.select import choose_prefill_schedule as choose

    # where FA3 runs, auto deals again for every graph backend (session 50: the segment
    # backends even at 16-256 tokens, 4-5% faster at 2,048) and keeps FlashInfer's schedule for
    # eager, which queues the dealing kernel after every plan; asked for, balanced anywhere
    for kernel in ("auto", "fa3"):
        for backend in ("full", "breakable", "tc_piecewise"):
            auto = choose("auto", "flashinfer", kernel, (9, 0), mla=False,
                          prefill_backend=backend)  # fmt: skip
            assert auto.name == "balanced" and backend in auto.reason and "2,048" in auto.reason
        eager = choose("auto", "flashinfer", kernel, (9, 0), mla=False, prefill_backend="eager")
        assert eager.name == "own" and "--prefill-schedule balanced" in eager.reason
        assert "eager" in eager.reason
        asked = choose("balanced", "flashinfer", kernel, (9, 0), mla=False,
                       prefill_backend="eager")  # fmt: skip
        assert asked.name == "balanced"

    # the start-up probe runs only where auto would deal again; where it fails, the rewrite
    # would be the host's (no faster for `full`), so auto keeps FlashInfer's schedule
    def no_probe() -> str | None:
        raise AssertionError("probed where auto keeps FlashInfer's schedule")

    failed = choose("auto", "flashinfer", "auto", (9, 0), False, "full",
                    lambda: "triton does not import (ImportError)")  # fmt: skip
    assert failed.name == "own" and "triton does not import" in failed.reason
    assert choose("auto", "flashinfer", "auto", (9, 0), False, "eager", no_probe).name == "own"
    broken = choose("auto", "flashinfer", "auto", (9, 0), False, "breakable",
                    lambda: "triton does not import (ImportError)")  # fmt: skip
    assert broken.name == "own" and "triton does not import" in broken.reason
    assert choose("own", "flashinfer", "auto", (9, 0), False, "full", no_probe).name == "own"
    for backend in ("full", "breakable"):  # where FA3 does not run, never
        why = {
            "torch attention": choose("auto", "torch", "auto", (9, 0), False, backend),
            "FA2": choose("auto", "flashinfer", "fa2", (9, 0), False, backend),
            "Blackwell": choose("auto", "flashinfer", "auto", (10, 0), False, backend),
            "CPU": choose("auto", "torch", "auto", None, False, backend),
            "MLA": choose("auto", "flashinfer", "auto", (9, 0), True, backend),
        }
        assert {c.name for c in why.values()} == {"own"}
        assert (
            "torch's" in why["torch attention"].reason
            and "--flashinfer-kernel fa2" in why["FA2"].reason
        )
        assert "sm100" in why["Blackwell"].reason and "MLA" in why["MLA"].reason
    assert (
        choose("own", "flashinfer", "auto", (9, 0), False, "full").reason
        == "asked for (--prefill-schedule own)"
    )
    with pytest.raises(ConfigError, match=r"--prefill-schedule balanced cannot run here: .*FA2"):
        choose("balanced", "flashinfer", "fa2", (9, 0), False, "full")


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


def fake_wrapper(items: np.ndarray, work_indptr: np.ndarray, spare: int = 5):
    """What SM90Rebalance reads of a FlashInfer wrapper after an SM90 plan (the backend, the plan
    info, the pinned schedule buffer the plan wrote and the int workspace its copy filled), both
    buffers host tensors here."""
    from service.ranks.attention.sm90_schedule import LaidOutPlan

    return LaidOutPlan(items, work_indptr, torch.device("cpu"), spare)


def device_schedule(w, balance) -> tuple[np.ndarray, np.ndarray]:
    """The schedule the kernel reads, from the wrapper's device int workspace (its layout as
    ``balance`` reads the plan info): the items in CTA order, as (n, 7) rows of ITEM_FIELDS, and
    the CTA ranges."""
    from service.ranks.attention.sm90_schedule import ITEM_FIELDS

    layout, _, _ = balance._layout(w, False)
    ints = w._int_workspace_buffer.view(torch.int32).cpu().numpy()
    at = layout.at
    wi = ints[at["work_indptr"] : at["work_indptr"] + balance.num_ctas + 1].copy()
    n = int(wi[-1])
    return np.stack([ints[at[f] : at[f] + n] for f in ITEM_FIELDS], 1), wi


@pytest.mark.parametrize("lens", [[2048], [1000, 700, 348], [2048] * 4])
def test_the_rewrite_deals_flashinfers_items_again_in_the_arrays_the_kernel_reads(lens):
    """The layout side of the rewrite, against a buffer laid out as FlashInfer's SM90 plan lays
    it out: every item once, the snake's CTA ranges, the busiest CTA shorter, and nothing
    outside the arrays' live entries changed."""
    from service.ranks.attention.sm90_schedule import SM90Rebalance

    theirs, their_wi = flashinfer_items(lens, 12, H100_SMS)
    w = fake_wrapper(theirs, their_wi)
    before = w._int_workspace_buffer.clone()
    balance = SM90Rebalance(torch.device("cpu"), num_ctas=H100_SMS)
    assert balance(w, 128) and balance.applied == 1
    ours, our_wi = device_schedule(w, balance)
    assert sorted(map(tuple, ours.tolist())) == sorted(map(tuple, theirs.tolist()))
    costs = item_costs(theirs[:, 0], theirs[:, 3], theirs[:, 4])
    # what the benchmark reads as FlashInfer's schedule stays FlashInfer's after the rewrite
    read_costs, read_wi = balance.planned(w, 128)
    assert read_costs.tolist() == costs.tolist() and read_wi.tolist() == their_wi.tolist()
    expect = snake(costs, H100_SMS)
    assert our_wi.tolist() == expect.work_indptr.tolist()
    assert np.array_equal(ours, theirs[expect.order])
    mine = makespan(item_costs(ours[:, 0], ours[:, 3], ours[:, 4]), our_wi.astype(np.int64))
    assert mine < makespan(costs, their_wi)
    # bytes between and after the arrays are as the plan left them
    changed = (w._int_workspace_buffer != before).numpy().view(bool)
    owned = np.zeros_like(changed)
    n = theirs.shape[0]
    for f, off in w.offsets.items():
        owned[off : off + 4 * (H100_SMS + 1 if f == "work_indptr" else n)] = True
    assert not changed[~owned].any()


def test_a_plan_it_cannot_read_keeps_flashinfers_schedule_and_says_so_once(caplog):
    from service.ranks.attention.sm90_schedule import SM90Rebalance

    theirs, wi = flashinfer_items([2048], 12, H100_SMS)
    w = fake_wrapper(theirs, wi)
    w._plan_info = w._plan_info[:-1]  # not the nine fields of PrefillPlanSM90Info
    before = w._int_workspace_buffer.clone()
    balance = SM90Rebalance(torch.device("cpu"), num_ctas=H100_SMS)
    with caplog.at_level("WARNING"):
        assert not balance(w, 128) and not balance(w, 128)
    assert torch.equal(w._int_workspace_buffer, before)
    warned = [r.message for r in caplog.records if "SM90 prefill schedule kept" in r.message]
    assert warned == ["SM90 prefill schedule kept as FlashInfer planned it: the plan info is not "
                      "FlashInfer's SM90 layout"]  # fmt: skip
    small = fake_wrapper(*flashinfer_items([1024], 12, H100_SMS))  # 96 items: one CTA each
    assert not balance(small, 128) and balance.kept == 3


def test_a_new_wrapper_in_a_dropped_wrappers_place_is_read_from_its_own_buffers(monkeypatch):
    """A bucket's wrappers are dropped when its capture fails on another rank; a new wrapper may
    get the old one's id and the same plan info, but the schedule must be read from, and written
    to, its own buffers."""
    from service.ranks.attention import sm90_schedule
    from service.ranks.attention.sm90_schedule import SM90Rebalance

    balance = SM90Rebalance(torch.device("cpu"), num_ctas=H100_SMS)
    old = fake_wrapper(*flashinfer_items([2048], 12, H100_SMS))
    assert balance(old, 128)
    new = fake_wrapper(*flashinfer_items([2048], 12, H100_SMS))
    new._plan_info = old._plan_info  # the same layout
    monkeypatch.setattr(sm90_schedule, "id", lambda w: 1, raising=False)  # the same id
    balance._layouts = {1: balance._layouts[id(old)]}
    before = new._int_workspace_buffer.clone()
    assert balance(new, 128, same_info=True)
    assert not torch.equal(new._int_workspace_buffer, before)  # its own buffer was rewritten
    items, _ = device_schedule(new, balance)
    theirs, _ = flashinfer_items([2048], 12, H100_SMS)
    assert sorted(map(tuple, items.tolist())) == sorted(map(tuple, theirs.tolist()))


def test_a_captured_rewrite_refuses_a_plan_whose_layout_moved():
    """``full`` captures the device rewrite with the plan's layout baked in; a later plan with
    another layout would have the graph's kernel read and write the wrong bytes, so it is an
    error, not a silent miss. The host rewrite cannot be deferred, and the device rewrite needs
    a CUDA device."""
    from service.ranks.attention.sm90_schedule import SM90Rebalance

    with pytest.raises(ValueError, match="needs a CUDA device"):
        SM90Rebalance(torch.device("cpu"), num_ctas=H100_SMS, on_device=True)
    balance = SM90Rebalance(torch.device("cpu"), num_ctas=H100_SMS)
    w = fake_wrapper(*flashinfer_items([2048], 12, H100_SMS))
    with pytest.raises(ValueError, match="needs the device rewrite"):
        balance(w, 128, defer=True)
    balance.on_device = True  # what a CUDA rank with triton has; deferred: nothing is launched
    before = w._int_workspace_buffer.clone()
    assert balance(w, 128, defer=True)
    assert torch.equal(w._int_workspace_buffer, before)
    balance._captured[id(w)] = ("deal", balance._layout(w, True))  # as the capture records it
    assert balance(w, 128, same_info=True, defer=True)  # the same layout: fine
    moved = fake_wrapper(*flashinfer_items([2048, 512], 12, H100_SMS))
    w._plan_info = moved._plan_info  # a plan with other offsets into the same buffers
    with pytest.raises(RuntimeError, match="layout changed under a captured"):
        balance(w, 128, defer=True)
    balance.forget(w)  # its bucket dropped: a new capture may record another layout
    assert balance(w, 128, defer=True)


def test_the_device_rewrite_is_not_launched_for_a_plan_of_one_item_per_cta(monkeypatch):
    """A segment backend's small buckets: one request of up to 1,024 tokens gives FA3 at most
    one item per CTA, which no schedule shortens, so no kernel is queued (with its launch the
    segment backends were 1-17% slower at 16-1,024 tokens on the H200, session 45). Inside a
    capture the kernel is always taken: the graph's replays deal later plans."""
    from service.ranks.attention.sm90_schedule import SM90Rebalance

    balance = SM90Rebalance(torch.device("cpu"), num_ctas=H100_SMS)
    balance.on_device = True  # what a CUDA rank with triton has
    queued: list[object] = []
    monkeypatch.setattr(balance, "_deal_on_device", lambda w, d, got: queued.append(w) or True)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    small = fake_wrapper(*flashinfer_items([1024], 12, H100_SMS))  # 96 items
    large = fake_wrapper(*flashinfer_items([2048], 12, H100_SMS))  # 192 items
    many = fake_wrapper(*flashinfer_items([64] * 12, 12, H100_SMS))  # 144 items of 64 rows
    assert not balance(small, 128) and balance.kept == 1 and queued == []
    assert balance(large, 128) and balance(many, 128) and queued == [large, many]
    capturing[0] = True
    assert balance(small, 128) and queued == [large, many, small]


@pytest.mark.parametrize("ctas", [H100_SMS, 78, 16])
def test_the_start_up_probe_is_a_plan_the_rewrite_really_deals(ctas):
    """The probe that decides, at start-up, whether the device rewrite is trusted compares it
    with the host rewrite on a synthetic plan: that plan must be one the host rewrite changes
    (a probe both rewrites left alone would prove nothing), laid out as FlashInfer lays its
    own (the layout checks pass)."""
    from service.ranks.attention.sm90_schedule import (
        SM90Rebalance,
        device_rewrite_error,
        probe_items,
    )

    probe = fake_wrapper(*probe_items(ctas), spare=3)  # as the probe lays it out
    before = probe._int_workspace_buffer.clone()
    assert SM90Rebalance(torch.device("cpu"), num_ctas=ctas)(probe, 128)
    assert not torch.equal(probe._int_workspace_buffer, before)
    items, _ = device_schedule(probe, SM90Rebalance(torch.device("cpu"), num_ctas=ctas))
    assert len(items) == -(-3 * ctas // 16) * 16  # every item still there
    try:
        import triton  # noqa: F401
    except ImportError:  # CI's CPU machine: the probe says why the device cannot deal
        assert "triton does not import" in device_rewrite_error(torch.device("cpu"), ctas)
