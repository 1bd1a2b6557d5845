"""Attention backend choice and FlashInfer's page-size-1 layout: pure parts, no GPU needed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from service.config import EngineConfig
from service.engine import Engine
from service.errors import ConfigError
from service.padding import PADDING_SLOT
from service.ranks.attention.flashinfer_backend import live_layout
from service.ranks.attention.paged_layout import paged_layout
from service.ranks.forward_batch import BatchLayout, ForwardMode
from service.ranks.select import choose_attention


def test_auto_takes_flashinfer_only_where_it_runs():
    ok = choose_attention("auto", "cuda", "bfloat16", 128, None)
    assert ok.name == "flashinfer"
    for args, why in [
        (("cpu", "float32", 128, None), "CUDA device"),
        (("cuda", "bfloat16", 128, "ImportError: no module"), "gpu` extra"),
        (("cuda", "bfloat16", 32, None), "head dim 32"),
        (("cuda", "float32", 128, None), "dtype float32"),
    ]:
        c = choose_attention("auto", *args)
        assert c.name == "torch" and why in c.reason, c


def test_explicit_flashinfer_that_cannot_run_says_what_to_change():
    with pytest.raises(ConfigError, match=r"head dim 32.*--attention-backend auto or torch"):
        choose_attention("flashinfer", "cuda", "bfloat16", 32, None)
    assert choose_attention("torch", "cuda", "bfloat16", 128, None).name == "torch"


def test_bad_attention_backend_is_refused():
    with pytest.raises(ConfigError, match="supported: \\['auto', 'flashinfer', 'torch'\\]"):
        EngineConfig(attention_backend="xformers")


def test_cpu_server_reports_torch_attention_and_why():
    e = Engine(EngineConfig(device="cpu", context_length=128, kv_cache_memory_bytes=16 << 20))
    att = e.resolved.to_json()["attention_backend"]
    assert att["name"] == "torch" and "CUDA device" in att["reason"]


layouts = st.integers(1, 6).flatmap(
    lambda n: st.tuples(
        st.permutations(range(8)).map(lambda p: tuple(p[:n])),
        st.lists(st.integers(0, 40), min_size=n, max_size=n),
        st.lists(st.integers(1, 24), min_size=n, max_size=n),
        st.integers(0, 3),
    )
)


@given(layouts)
def test_paged_layout_points_at_each_requests_own_slots(case):
    rows, prefix, extend, extra = case
    ctx = 64
    table = torch.arange(8 * ctx).view(8, ctx) + 1000  # slot of (row r, token j): 1000+r*ctx+j
    layout = BatchLayout(ForwardMode.EXTEND, rows, tuple(prefix), tuple(extend))
    pl = paged_layout(layout, ctx, num_slots=len(rows) + extra)
    kv = pl.kv_indices(table).tolist()
    assert pl.num_requests == len(rows) + extra and pl.num_query_rows == sum(extend)
    for i, (r, p, e) in enumerate(zip(rows, prefix, extend, strict=True)):
        assert pl.qo_indptr[i + 1] - pl.qo_indptr[i] == e
        lo, hi = int(pl.kv_indptr[i]), int(pl.kv_indptr[i + 1])
        assert kv[lo:hi] == [1000 + r * ctx + j for j in range(p + e)]
    for i in range(len(rows), len(rows) + extra):  # sentinels: no queries, the padding slot
        assert pl.qo_indptr[i + 1] == pl.qo_indptr[i]
        assert kv[int(pl.kv_indptr[i]) : int(pl.kv_indptr[i + 1])] == [PADDING_SLOT]
    assert pl.kv_last_page_len.tolist() == [1] * pl.num_requests
    # the host lengths handed to FlashInfer's plan agree with the indptrs it would derive them from
    kv_lens = (pl.kv_indptr[1:] - pl.kv_indptr[:-1]).tolist()
    assert pl.kv_lens.tolist() == kv_lens and pl.kv_lens.dtype == torch.int32
    assert pl.max_kv_len == max(kv_lens)
    assert pl.max_q_len == int((pl.qo_indptr[1:] - pl.qo_indptr[:-1]).max())


def test_paged_layout_refuses_what_does_not_fit():
    layout = BatchLayout(ForwardMode.EXTEND, (0, 1), (0, 0), (10, 70))
    with pytest.raises(ValueError, match="exceeds context 64"):
        paged_layout(layout, 64)
    with pytest.raises(ValueError, match="do not fit 1 request slots"):
        paged_layout(BatchLayout(ForwardMode.EXTEND, (0, 1), (0, 0), (1, 1)), 64, 1)


def test_capture_layout_sentinels_are_dropped_before_padding():
    # a capture batch lists its zero-length sentinels; the graph layout re-adds them at the end
    synthetic = BatchLayout(ForwardMode.EXTEND, (0, 1, 0, 0), (0, 0, 0, 0), (64, 36, 0, 0))
    live = live_layout(synthetic)
    assert live.req_pool_indices == (0, 1) and live.extend_lens == (64, 36)
    pl = paged_layout(live, 64, num_slots=4)
    assert pl.kv_indptr.tolist() == [0, 64, 100, 101, 102]


def test_mla_takes_flashinfer_for_decode_graphs_only_at_its_widths():
    fi = choose_attention("auto", "cuda", "bfloat16", 192, None, mla=(512, 64))
    assert fi.name == "flashinfer" and "MLA: decode graphs on FlashInfer's MLA" in fi.reason
    other = choose_attention("auto", "cuda", "bfloat16", 192, None, mla=(32, 8))
    assert other.name == "torch" and "not FlashInfer's (512, 64)" in other.reason
    with pytest.raises(ConfigError, match="MLA widths"):
        choose_attention("flashinfer", "cuda", "bfloat16", 192, None, mla=(32, 8))
