"""The MLP's token chunks: the policy (pure), the module's chunked path against its whole path, and
the row-parallel projection writing its rows into a larger output."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from service.model import llama
from service.model.arch_config import parse_arch_config
from service.model.builtin import BUILTIN_CONFIG
from service.model.kernels import Kernels
from service.model.mlp_chunks import BUDGET_BYTES, ROW_ALIGN, chunk_rows
from service.model.parallel import RowParallelLinear, TPGroup

QWEN_I = 8960  # Qwen2.5-1.5B's intermediate size: the measured shape


def test_the_measured_model_runs_4096_tokens_whole_and_8192_as_two_halves():
    """docs/benchmarks.md, session 42: four 2,048-token chunks cost 5% of the MLP at 8,192."""
    got = {t: chunk_rows(t, QWEN_I, 2) for t in (1, 2048, 3000, 4096, 4993, 6000, 8192, 16384)}
    assert got == {1: 1, 2048: 2048, 3000: 3000, 4096: 4096, 4993: 4993, 6000: 3072,
                   8192: 4096, 16384: 4096}  # fmt: skip
    # the pair's intermediates at 2 bytes: (T, 2I) and (T, I), 3 x I x 2 a token
    assert chunk_rows(4096, QWEN_I, 4) == 2048  # float32 holds twice the bytes


@given(
    rows=st.integers(1, 200_000),
    inter=st.integers(1, 60_000),
    dtype_bytes=st.sampled_from([1, 2, 4]),
    budget=st.sampled_from([BUDGET_BYTES, 1 << 20, 12_345]),
)
def test_chunks_are_the_fewest_equal_aligned_ones_that_fit(rows, inter, dtype_bytes, budget):
    step = chunk_rows(rows, inter, dtype_bytes, budget)
    per_row = 3 * inter * dtype_bytes
    fit = max(1, budget // per_row)
    assert 1 <= step <= rows
    if rows <= fit:
        assert step == rows  # whole whenever it fits
        return
    assert step % ROW_ALIGN == 0 or step == rows
    assert step < fit + ROW_ALIGN  # over the budget by under one row tile
    needed = -(-rows // fit)  # the fewest chunks that fit the budget
    chunks = -(-rows // step)
    assert chunks <= needed
    # equal shares, each rounded up to a row tile: the last chunk is short by at most that
    assert rows - (chunks - 1) * step >= step - ROW_ALIGN * needed


def test_a_bad_shape_is_named_and_an_empty_call_runs_whole():
    with pytest.raises(ValueError, match="must not be negative"):
        chunk_rows(-1, QWEN_I, 2)
    with pytest.raises(ValueError, match="must be positive"):
        chunk_rows(16, 0, 2)
    assert chunk_rows(0, QWEN_I, 2) == 0


def small_mlp(seed: int) -> llama.MLP:
    cfg = parse_arch_config(dict(BUILTIN_CONFIG))
    mlp = llama.MLP(cfg, TPGroup(), Kernels())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return mlp


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(200, 700), budget_rows=st.integers(1, 199), seed=st.integers(0, 99))
def test_the_chunked_mlp_equals_the_whole_mlp_without_joining_copies(rows, budget_rows, seed):
    """The built-in model's MLP (I = 768) with a budget of ``budget_rows`` tokens: the chunked
    output equals the whole forward's, row for row, within float32 rounding (the CPU GEMM blocks
    a 5-row chunk differently from 261 rows), and no ``torch.cat`` joins the chunks (each writes
    its rows in place). A chunk loop that dropped the last partial chunk, wrote a chunk at the
    wrong rows or summed rows twice fails."""
    mlp = small_mlp(seed)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = mlp(x)
        per_row = 3 * 768 * x.element_size()
        small = functools.partial(chunk_rows, budget=budget_rows * per_row)
        assert small(rows, 768, x.element_size()) < rows  # the chunked path runs

        def no_cat(*a, **kw):
            raise AssertionError("the chunks were joined by a copy")

        with pytest.MonkeyPatch.context() as mp:  # undone per example
            mp.setattr(llama, "chunk_rows", small)
            mp.setattr(torch, "cat", no_cat)
            got = mlp(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@dataclass(frozen=True)
class TwoRanksOnCPU(TPGroup):
    """Rank 0 of two whose peer holds the same partial sum, reduced the way gloo's functional
    collective returns it on CPU: as a new tensor."""

    rank: int = 0
    world_size: int = 2

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_the_row_parallel_projection_writes_the_summed_rows_into_the_given_rows():
    """down_proj(x, out=rows of a larger output): the sum over ranks lands in those rows and
    nowhere else, also where the collective returns a new tensor instead of reducing in
    place."""
    gen = torch.Generator().manual_seed(3)
    for tp in (TPGroup(), TwoRanksOnCPU()):
        proj = RowParallelLinear(64, 24, tp)
        with torch.no_grad():
            proj.weight.copy_(torch.randn(proj.weight.shape, generator=gen))
        x = torch.randn(10, proj.in_local, generator=gen)
        out = torch.full((30, 24), 7.0)
        got = proj(x, out=out[10:20])
        assert got.data_ptr() == out[10:20].data_ptr()
        torch.testing.assert_close(out[10:20], proj(x))
        assert bool((out[:10] == 7).all()) and bool((out[20:] == 7).all())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_a_captured_bucket_replays_the_chunked_mlp_and_equals_eager(backend, device, monkeypatch):
    """With a budget of 100 tokens, the 256-token bucket is captured with the MLP in two chunks
    of 128 (inside the graphs), and its replay of a live 108-token batch equals the eager
    forward, which runs those 108 tokens whole."""
    from service.engine import Engine
    from tests.batches import hit_batch
    from tests.test_honest_replay import graph_cfg

    small = functools.partial(chunk_rows, budget=100 * 3 * 768 * 4)  # the built-in model, fp32
    seen: list[tuple[int, int]] = []

    def recorded(rows: int, inter: int, dtype_bytes: int) -> int:
        seen.append((rows, small(rows, inter, dtype_bytes)))
        return seen[-1][1]

    monkeypatch.setattr(llama, "chunk_rows", recorded)
    slots = 4 if backend == "full" else None
    e = Engine(graph_cfg(backend, device, buckets=(256,), full_request_slots=slots))
    try:
        assert (256, 128) in seen  # the capture took the chunked path
        w = e.executor.worker
        batch, decision = hit_batch(e, (37, 60, 11), 256, seed=5)
        with torch.inference_mode():
            want = w.eager_runner.run(batch, decision).clone()
            assert seen[-1] == (108, 108)  # eager: the live tokens, whole
            got = w.runner.run(batch, decision)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        e.shutdown()
