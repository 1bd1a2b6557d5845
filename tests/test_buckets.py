"""The bucket rules (DESIGN invariants 1-5), as property tests and the seed's examples."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.buckets import (
    DEFAULT_FULL_REQUEST_SLOTS,
    GRAPH_BACKENDS,
    MISS_DISABLED,
    MISS_PADDING_OVER_LIMIT,
    MISS_TOO_MANY_REQUESTS,
    MISS_TOO_MANY_TOKENS,
    PlanError,
    ResolvedRequestPool,
    agree_plans,
    decide_replay,
    default_prefill_buckets,
    drop_buckets,
    partition_bucket,
    resolve_plan,
)

backends = st.sampled_from(GRAPH_BACKENDS)
bucket_lists = st.lists(st.integers(1, 40_000), min_size=1, max_size=12)


@st.composite
def plans(draw):
    backend = draw(backends)
    pool = draw(st.integers(1, 64))
    slots = draw(st.one_of(st.none(), st.integers(1, pool)))
    return resolve_plan(
        backend=backend,
        context_length=draw(st.integers(1, 8192)),
        pool=ResolvedRequestPool(pool),
        max_prefill_tokens=draw(st.integers(1, 32_768)),
        buckets=draw(st.one_of(st.none(), bucket_lists)),
        full_request_slots=slots,
        max_padding_fraction=draw(st.floats(0.0, 1.0)),
    )


@given(st.integers(1, 100_000), st.integers(1, 10_000))
def test_partition_sums_fits_and_is_minimal(num_tokens, context_length):
    lens = partition_bucket(num_tokens, context_length)
    assert sum(lens) == num_tokens
    assert all(1 <= n <= context_length for n in lens)
    assert len(lens) == math.ceil(num_tokens / context_length)
    # one request fewer cannot hold the bucket: the count is minimal
    assert (len(lens) - 1) * context_length < num_tokens


@settings(max_examples=300)
@given(plans())
def test_every_captured_bucket_is_legal_and_partitioned(plan):
    cap = plan.context_length * plan.capture_request_capacity
    for b in plan.buckets:
        assert b.num_tokens <= cap
        assert b.num_tokens <= plan.max_prefill_tokens
        real = [n for n in b.capture_seq_lens if n > 0]
        assert sum(b.capture_seq_lens) == b.num_tokens
        assert all(n <= plan.context_length for n in b.capture_seq_lens)
        assert len(real) == math.ceil(b.num_tokens / plan.context_length)
        assert len(real) <= plan.capture_request_capacity
        if plan.backend == "full":
            assert len(b.capture_seq_lens) == plan.capture_request_capacity
            # sentinels come after every real request
            assert list(b.capture_seq_lens[: len(real)]) == real
        else:
            assert len(b.capture_seq_lens) == len(real)
    for d in plan.dropped:
        assert d.num_tokens > cap or d.num_tokens > plan.max_prefill_tokens
        assert str(d.num_tokens) in d.reason
    assert plan.bucket_sizes == tuple(sorted(plan.bucket_sizes))
    if not plan.buckets:
        r = plan.disabled_reason
        assert plan.backend in r and str(plan.context_length) in r
        assert str(plan.capture_request_capacity) in r
    else:
        assert plan.disabled_reason is None


@settings(max_examples=300)
@given(plans(), st.integers(1, 40_000), st.integers(1, 80))
def test_replay_never_picks_a_smaller_or_uncaptured_bucket(plan, num_tokens, num_requests):
    num_requests = min(num_requests, num_tokens)
    d = decide_replay(plan, num_tokens, num_requests)
    if d.hit:
        assert d.bucket in plan.bucket_sizes
        assert d.bucket >= num_tokens
        assert d.padded_tokens == d.bucket - num_tokens
        assert d.padded_tokens <= plan.max_padding_fraction * d.bucket
        assert num_requests <= plan.capture_request_capacity
        # smallest that fits
        assert all(s < num_tokens for s in plan.bucket_sizes if s < d.bucket)
    else:
        assert d.bucket is None and d.miss_reason is not None
        if not plan.buckets:
            assert d.miss_reason == MISS_DISABLED
        elif d.miss_reason == MISS_TOO_MANY_TOKENS:
            assert num_tokens > max(plan.bucket_sizes)
        elif d.miss_reason == MISS_TOO_MANY_REQUESTS:
            assert num_requests > plan.capture_request_capacity


@given(st.integers(1, 10_000), st.integers(1, 64), st.integers(1, 100_000))
def test_empty_plan_never_raises(context_length, pool, bucket_base):
    # every bucket above the cap: the plan is empty, replay decisions still answer
    cap = context_length * pool
    plan = resolve_plan(
        backend="tc_piecewise",
        context_length=context_length,
        pool=ResolvedRequestPool(pool),
        max_prefill_tokens=10**9,
        buckets=[cap + bucket_base],
    )
    assert not plan.enabled and plan.disabled_reason
    assert decide_replay(plan, 1, 1).miss_reason == MISS_DISABLED


@given(st.integers(1, 100_000))
def test_default_buckets_ascend_and_end_at_max(max_tokens):
    sizes = default_prefill_buckets(max_tokens)
    assert list(sizes) == sorted(set(sizes))
    assert sizes[-1] == max_tokens
    assert all(s <= max_tokens for s in sizes)
    # consecutive buckets at most 1.5x apart above 16, so padding stays under a third
    for a, b in itertools.pairwise(sizes):
        if a >= 16:
            assert b <= math.ceil(a * 1.5) or b == max_tokens


def test_seed_breakable_two_requests():
    plan = resolve_plan(
        backend="breakable",
        context_length=2048,
        pool=ResolvedRequestPool(8),
        max_prefill_tokens=4096,
        buckets=[4096],
    )
    assert [(b.num_tokens, b.capture_seq_lens) for b in plan.buckets] == [(4096, (2048, 2048))]
    d = decide_replay(plan, 2602, 2)
    assert (d.hit, d.bucket, d.padded_tokens) == (True, 4096, 4096 - 2602)


def test_seed_full_four_slots_has_sentinels():
    plan = resolve_plan(
        backend="full",
        context_length=2048,
        pool=ResolvedRequestPool(8),
        max_prefill_tokens=4096,
        buckets=[4096],
        full_request_slots=4,
    )
    assert plan.buckets[0].capture_seq_lens == (2048, 2048, 0, 0)
    assert decide_replay(plan, 4096, 5).miss_reason == MISS_TOO_MANY_REQUESTS


def test_bucket_above_cap_is_dropped_with_reason():
    plan = resolve_plan(
        backend="tc_piecewise",
        context_length=2048,
        pool=ResolvedRequestPool(2),
        max_prefill_tokens=16384,
        buckets=[4096, 8192],
    )
    assert plan.bucket_sizes == (4096,)
    (dropped,) = plan.dropped
    assert dropped.num_tokens == 8192
    assert (
        "context_length 2048 x 2" in dropped.reason and "--max-running-requests" in dropped.reason
    )


def test_full_default_slots_are_capped_by_the_pool():
    plan = resolve_plan(
        backend="full", context_length=64, pool=ResolvedRequestPool(3), max_prefill_tokens=4096
    )
    assert plan.capture_request_capacity == 3
    big = resolve_plan(
        backend="full", context_length=64, pool=ResolvedRequestPool(100), max_prefill_tokens=4096
    )
    assert big.capture_request_capacity == DEFAULT_FULL_REQUEST_SLOTS


def test_unresolved_pool_is_impossible():
    with pytest.raises(PlanError, match="unresolved"):
        ResolvedRequestPool(None)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="ResolvedRequestPool"):
        resolve_plan(
            backend="breakable",
            context_length=2048,
            pool=None,
            max_prefill_tokens=4096,  # type: ignore[arg-type]
        )


def test_eager_backend_is_disabled_without_warning_worthy_state():
    plan = resolve_plan(
        backend="eager", context_length=2048, pool=ResolvedRequestPool(8), max_prefill_tokens=4096
    )
    assert not plan.enabled and "eager" in plan.disabled_reason
    assert plan.to_json()["max_capture_tokens"] == 0


def test_padding_limit_misses():
    plan = resolve_plan(
        backend="breakable",
        context_length=4096,
        pool=ResolvedRequestPool(4),
        max_prefill_tokens=4096,
        buckets=[4096],
        max_padding_fraction=0.25,
    )
    assert decide_replay(plan, 1000, 1).miss_reason == MISS_PADDING_OVER_LIMIT
    assert decide_replay(plan, 3500, 1).hit


@given(st.lists(st.integers(1, 16), min_size=1, max_size=4), st.integers(64, 512))
def test_agreed_plan_is_the_intersection(pools, context_length):
    per_rank = [
        resolve_plan(
            backend="breakable",
            context_length=context_length,
            pool=ResolvedRequestPool(p),
            max_prefill_tokens=8192,
        )
        for p in pools
    ]
    agreed = agree_plans(per_rank)
    expected = set.intersection(*(set(p.bucket_sizes) for p in per_rank))
    assert set(agreed.bucket_sizes) == expected
    assert agreed.capture_request_capacity == min(pools)
    for b in agreed.buckets:
        assert len(b.capture_seq_lens) <= min(pools)


def test_capture_failure_drops_bucket_with_reason():
    plan = resolve_plan(
        backend="breakable",
        context_length=2048,
        pool=ResolvedRequestPool(8),
        max_prefill_tokens=8192,
        buckets=[1024, 4096],
    )
    out = drop_buckets(plan, {4096: "rank 1: CUDA out of memory"})
    assert out.bucket_sizes == (1024,)
    assert any(d.num_tokens == 4096 and "out of memory" in d.reason for d in out.dropped)
    none_left = drop_buckets(out, {1024: "boom"})
    assert not none_left.enabled and none_left.disabled_reason


def test_replay_rejects_impossible_batches():
    plan = resolve_plan(
        backend="breakable", context_length=64, pool=ResolvedRequestPool(4), max_prefill_tokens=256
    )
    with pytest.raises(PlanError):
        decide_replay(plan, 0, 1)
    with pytest.raises(PlanError):
        decide_replay(plan, 2, 3)
