"""The per-step host layouts (numpy, one copy each) against a per-request Python reference: the
batch's positions and offsets, and the request-to-token table writes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

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


@settings(max_examples=60, deadline=None)
@given(requests.filter(lambda reqs: sum(e for _, _, e in reqs) > 0), st.integers(0, 9),
       st.integers(0, 3), st.integers(0, 2**31))  # fmt: skip
def test_static_copy_pads_and_fills_sentinels(reqs, extra_tokens, extra_slots, seed):
    """A replay's static inputs from the packed batch (two copies and a pad): the real tokens and
    requests, padded tokens at id 0 / position 0 / the padding slot, sentinel requests at row 0
    with nothing to extend and starting past the real tokens, whatever a previous replay left."""
    from service.padding import PADDING_SLOT
    from service.ranks.runners.static_buffers import PrefillStaticBuffers

    layout = BatchLayout(
        ForwardMode.EXTEND,
        tuple(r for r, _, _ in reqs),
        tuple(p for _, p, _ in reqs),
        tuple(e for _, _, e in reqs),
    )
    t, b = layout.num_tokens, layout.num_requests
    batch = ForwardBatch.build(layout, [1000 + j for j in range(t)], [2000 + j for j in range(t)],
                               torch.device("cpu"))  # fmt: skip
    bucket, slots = t + extra_tokens, b + extra_slots
    bufs = PrefillStaticBuffers.allocate(bucket + 4, slots + 2, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    # stale values of an earlier replay: every token row through a real copy (the buffers track
    # which rows they padded), the request rows written directly (copy_from rewrites them all)
    bufs.copy_tokens(_random_batch(bucket + 4, g), bucket + 4)
    bufs.requests.copy_(torch.randint(1, 99, bufs.requests.shape, generator=g))
    view = bufs.copy_from(batch, bucket, slots)
    assert view.input_ids.tolist() == batch.input_ids.tolist() + [0] * extra_tokens
    assert view.positions.tolist() == batch.positions.tolist() + [0] * extra_tokens
    assert (
        view.out_cache_loc.tolist() == batch.out_cache_loc.tolist() + [PADDING_SLOT] * extra_tokens
    )
    assert view.req_pool_indices.tolist() == list(layout.req_pool_indices) + [0] * extra_slots
    assert view.prefix_lens.tolist() == list(layout.prefix_lens) + [0] * extra_slots
    assert view.extend_lens.tolist() == list(layout.extend_lens) + [0] * extra_slots
    assert view.extend_start_loc.tolist() == batch.extend_start_loc.tolist() + [t] * extra_slots


class _Writes(TorchDispatchMode):
    """Counts the device ops (copies and fills) a copy into static buffers makes: into 2-D
    tensors of ``rows`` rows only (the (3, T) token rows, not the request rows), or every one
    (``None``)."""

    def __init__(self, rows: int | None = None) -> None:
        super().__init__()
        self.rows = rows
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        into = args[0] if args else None
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.fill_.Scalar) and (
            self.rows is None or (into.dim() == 2 and into.shape[0] == self.rows)
        ):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _random_batch(n: int, g: torch.Generator) -> ForwardBatch:
    """One request of ``n`` tokens whose ids, positions and KV slots are random and non-zero
    (never the pad token's)."""
    layout = BatchLayout(ForwardMode.EXTEND, (0,), (0,), (n,))
    batch = ForwardBatch.build(
        layout, torch.randint(1, 99, (n,), generator=g).tolist(),
        torch.randint(1, 99, (n,), generator=g).tolist(), torch.device("cpu"),
    )  # fmt: skip
    batch.positions.copy_(torch.randint(1, 99, (n,), generator=g))
    return batch


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["tokens", "from", "synthetic"]), st.integers(1, 24),
                          st.integers(0, 8)), min_size=1, max_size=8),
       st.integers(0, 2**31))  # fmt: skip
def test_padding_holds_over_any_sequence_of_copies_and_pads_only_dirty_rows(steps, seed):
    """Over any sequence of replays (either copy) and captures, each replay's rows past its
    tokens hold the pad token, and a copy pads only rows an earlier batch or capture wrote: a
    batch no smaller than every token row written since the last pad copies once (a pad kept
    unconditionally passes the first check and fails the count; a pad skipped wrongly fails
    the first)."""
    from service.padding import PADDING_SLOT
    from service.ranks.runners.static_buffers import PrefillStaticBuffers

    bufs = PrefillStaticBuffers.allocate(32, 4, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    written = 0  # the highest token row holding anything but the pad token: a model of the rows
    for kind, n, extra in steps:
        bucket = min(n + extra, 32)
        if kind == "synthetic":
            bufs.load_synthetic((n,), n, 1)
            written = max(written, n)
            continue
        batch = _random_batch(n, g)
        with _Writes(3) as mode:
            view = (bufs.copy_tokens(batch, bucket) if kind == "tokens"
                    else bufs.copy_from(batch, bucket, 2))  # fmt: skip
        assert view.input_ids.tolist() == batch.input_ids.tolist() + [0] * (bucket - n)
        assert view.positions.tolist() == batch.positions.tolist() + [0] * (bucket - n)
        assert view.out_cache_loc.tolist() == (
            batch.out_cache_loc.tolist() + [PADDING_SLOT] * (bucket - n)
        )
        assert mode.n == (2 if min(bucket, written) > n else 1)
        written = n if bucket >= written else max(written, n)


def test_static_copy_refuses_a_batch_that_is_not_packed():
    import dataclasses

    from service.ranks.runners.static_buffers import PrefillStaticBuffers

    layout = BatchLayout(ForwardMode.EXTEND, (0,), (0,), (3,))
    batch = ForwardBatch.build(layout, [1, 2, 3], [4, 5, 6], torch.device("cpu"))
    bufs = PrefillStaticBuffers.allocate(8, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"ForwardBatch\.build"):
        bufs.copy_from(dataclasses.replace(batch, packed=None), 8, 2)


@pytest.mark.parametrize("extra_tokens", [0, 5])
def test_token_copy_pads_the_token_rows_and_leaves_the_request_rows_alone(extra_tokens):
    """The segment backends' load under planned attention: token rows as ``copy_from`` writes
    them, the batch's own request tensors in the view (live requests only), and the static
    request rows not written (their graphs read no request tensor)."""
    from service.padding import PADDING_SLOT
    from service.ranks.runners.static_buffers import PrefillStaticBuffers

    layout = BatchLayout(ForwardMode.EXTEND, (3, 1), (0, 0), (4, 2))
    batch = ForwardBatch.build(layout, list(range(100, 106)), list(range(200, 206)),
                               torch.device("cpu"))  # fmt: skip
    bufs = PrefillStaticBuffers.allocate(16, 4, torch.device("cpu"))
    stale = BatchLayout(ForwardMode.EXTEND, (0,), (0,), (16,))
    bufs.copy_tokens(ForwardBatch.build(stale, [77] * 16, [77] * 16, torch.device("cpu")), 16)
    bufs.positions.fill_(77)  # the stale batch's positions ran 0-15: one value past the bucket
    bufs.requests.fill_(55)
    bucket = 6 + extra_tokens
    view = bufs.copy_tokens(batch, bucket)
    assert view.input_ids.tolist() == list(range(100, 106)) + [0] * extra_tokens
    assert view.positions.tolist() == [0, 1, 2, 3, 0, 1] + [0] * extra_tokens
    assert view.out_cache_loc.tolist() == list(range(200, 206)) + [PADDING_SLOT] * extra_tokens
    assert view.input_ids.data_ptr() == bufs.input_ids.data_ptr()  # what the graphs read
    assert view.req_pool_indices.tolist() == [3, 1] and view.extend_lens.tolist() == [4, 2]
    assert view.extend_start_loc.tolist() == [0, 4]
    assert bufs.requests.unique().tolist() == [55]
    assert bufs.tokens[:, bucket:].unique().tolist() == [77]  # nothing past the bucket
    with pytest.raises(ValueError, match="does not fit bucket"):
        bufs.copy_tokens(batch, 5)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20), st.booleans()), max_size=12))
def test_rows_to_pad_keeps_every_row_a_view_reads_past_the_live_ones_padded(steps):
    """service.padding.rows_to_pad against a row-by-row model of a buffer, over any sequence of
    copies and captures (``capture``: rows up to its width written, not the pad, and the mark
    moved past them): after each copy the rows the view reads past the live ones hold the pad
    and every row from the kept mark on is pad; a copy at least as long as the mark pads
    nothing (the copy it saves)."""
    from service.padding import rows_to_pad

    rows = ["pad"] * 24
    mark = 0
    for live, extra, capture in steps:
        width = min(live + extra, 24)
        live = min(live, width)
        if capture:
            rows[:width] = ["synthetic"] * width
            mark = max(mark, width)
            continue
        rows[:live] = ["live"] * live
        before = mark
        start, end, mark = rows_to_pad(live, width, mark)
        assert start == live and live <= end <= width
        if live >= before:
            assert end == start  # nothing past the live rows was written since the last pad
        rows[start:end] = ["pad"] * (end - start)
        assert rows[live:width] == ["pad"] * (width - live), (live, width, rows)
        assert all(r == "pad" for r in rows[mark:]), (mark, rows)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 8), st.integers(0, 8)), min_size=1,
                max_size=8), st.integers(0, 2**31))  # fmt: skip
def test_decode_copy_fills_the_live_slots_and_pads_the_rest_in_one_copy_where_it_can(steps, seed):
    """A decode step's static inputs over any sequence of steps and captures: the live
    requests' ids, positions (= prefix), KV slots and rows in the first B slots, every slot past
    them up to the size padded (token 0, position 0, the padding slot, the sentinel row), with
    one copy into the rows, and a second only where a slot past B was written since it was
    last padded (a pad copied every step fails the count, a pad skipped wrongly the values)."""
    from service.padding import PADDING_POSITION, PADDING_SLOT, PADDING_TOKEN_ID, SENTINEL_ROW
    from service.ranks.runners.decode import DecodeStaticBuffers

    bufs = DecodeStaticBuffers.allocate(16, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    written = 0  # a model: the highest slot holding anything but the pad
    for capture, b, extra in steps:
        size = min(b + extra, 16)
        if capture:
            bufs.load_synthetic(size)
            written = max(written, size)
            continue
        rows = torch.randperm(50, generator=g)[:b].add(1).tolist()
        prefix = torch.randint(1, 99, (b,), generator=g).tolist()
        layout = BatchLayout(ForwardMode.DECODE, tuple(rows), tuple(prefix), (1,) * b)
        slots = torch.randint(1, 999, (b,), generator=g).tolist()
        ids = torch.randint(1, 99, (b,), generator=g).tolist()
        batch = ForwardBatch.build(layout, ids, slots, torch.device("cpu"))
        with _Writes() as mode:
            view = bufs.copy_from(batch, size)
        pad = size - b
        assert view.input_ids.tolist() == ids + [PADDING_TOKEN_ID] * pad
        assert view.positions.tolist() == prefix + [PADDING_POSITION] * pad
        assert view.prefix_lens.tolist() == prefix + [PADDING_POSITION] * pad
        assert view.out_cache_loc.tolist() == slots + [PADDING_SLOT] * pad
        assert view.req_pool_indices.tolist() == rows + [SENTINEL_ROW] * pad
        assert view.extend_lens.tolist() == [1] * size
        assert view.extend_start_loc.tolist() == list(range(size))
        assert mode.n == (2 if min(size, written) > b else 1)
        written = b if size >= written else max(written, b)


def test_decode_copy_refuses_a_batch_it_cannot_take_in_one_copy():
    import dataclasses

    from service.ranks.runners.decode import DecodeStaticBuffers

    bufs = DecodeStaticBuffers.allocate(4, torch.device("cpu"))
    layout = BatchLayout(ForwardMode.DECODE, (1, 2), (5, 6), (1, 1))
    batch = ForwardBatch.build(layout, [3, 4], [7, 8], torch.device("cpu"))
    with pytest.raises(ValueError, match=r"ForwardBatch\.build \(packed\)"):
        bufs.copy_from(dataclasses.replace(batch, packed=None), 4)
    with pytest.raises(ValueError, match="does not fit size 1"):
        bufs.copy_from(batch, 1)
    extend = BatchLayout(ForwardMode.EXTEND, (1,), (0,), (2,))
    with pytest.raises(ValueError, match="one token per request"):
        bufs.copy_from(ForwardBatch.build(extend, [3, 4], [7, 8], torch.device("cpu")), 4)
