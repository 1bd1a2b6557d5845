"""The per-step host layouts (numpy, one copy each) against a per-request Python reference: the
batch's positions and offsets, and the request-to-token table writes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.ranks.kv_pool import ReqToTokenPool

CTX = 32

requests = st.lists(
    st.tuples(st.integers(0, 7), st.integers(0, 20), st.integers(0, 12)),  # row, prefix, new
    min_size=1,
    max_size=6,
    unique_by=lambda r: r[0],
)


@settings(max_examples=60, deadline=None)
@given(requests)
def test_batch_tensors_match_a_per_request_loop(reqs):
    rows = tuple(r for r, _, _ in reqs)
    prefix = tuple(p for _, p, _ in reqs)
    extend = tuple(e for _, _, e in reqs)
    layout = BatchLayout(ForwardMode.EXTEND, rows, prefix, extend)
    t = sum(extend)
    ids = [1000 + j for j in range(t)]
    slots = [2000 + j for j in range(t)]
    b = ForwardBatch.build(layout, ids, slots, torch.device("cpu"))
    want_pos, want_start, start = [], [], 0
    for p, e in zip(prefix, extend, strict=True):
        want_pos += range(p, p + e)
        want_start.append(start)
        start += e
    assert b.input_ids.tolist() == ids and b.out_cache_loc.tolist() == slots
    assert b.positions.tolist() == want_pos
    assert b.req_pool_indices.tolist() == list(rows)
    assert b.prefix_lens.tolist() == list(prefix) and b.extend_lens.tolist() == list(extend)
    assert b.extend_start_loc.tolist() == want_start
    assert b.input_ids.dtype == b.positions.dtype == torch.int64


def test_batch_tensors_refuse_mismatched_lengths():
    layout = BatchLayout(ForwardMode.EXTEND, (0,), (0,), (3,))
    with pytest.raises(ValueError, match="3 new tokens but 2 ids"):
        ForwardBatch.build(layout, [1, 2], [1, 2, 3], torch.device("cpu"))


@settings(max_examples=60, deadline=None)
@given(requests)
def test_row_writes_match_a_per_write_loop(reqs):
    pool = ReqToTokenPool(8, CTX, torch.device("cpu"))
    want = torch.zeros(8, CTX, dtype=torch.int64)
    writes = []
    for row, start, n in reqs:
        start = min(start, CTX - n)
        slots = [100 * (row + 1) + j for j in range(n)]
        writes.append((row, start, slots))
        want[row, start : start + n] = torch.tensor(slots, dtype=torch.int64)
    pool.write_many(writes)
    assert torch.equal(pool.table, want)


def test_a_row_write_past_the_context_is_refused_and_writes_nothing():
    pool = ReqToTokenPool(2, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="would hold 9 tokens, more than context_length 8"):
        pool.write_many([(0, 0, [1, 2]), (1, 6, [3, 4, 5])])
    assert not pool.table.any()
