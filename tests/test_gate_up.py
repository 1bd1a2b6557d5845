"""The MLP's gate_up GEMM + SiLU-and-mul as one Triton kernel: which token counts take it (a pure
policy), which ranks may choose it and why, what /server_info says; on CUDA (gpu marker) the
kernel against a float32 reference, the model with it against the model without it, and the
op inside a compiled piece."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from service.config import EngineConfig, GraphConfig
from service.engine import Engine
from service.errors import ConfigError
from service.model.gate_up_tiles import (
    LARGE_MIN,
    SMALL_MAX,
    middle_ranges,
    shape_blocker,
    tile_for,
)
from service.ranks.select import choose_gate_up
from tests.batches import cpu_server_info, engine_flags

H100_SMEM = 227 * 1024  # bytes of shared memory a block may use on sm90
SM90 = (9, 0)


@given(st.integers(min_value=-4, max_value=40_000), st.booleans())
def test_fused_tiles_cover_exactly_the_measured_winning_sizes(tokens, captured):
    tile = tile_for(tokens, captured)
    middle = any(low <= tokens <= high for low, high in middle_ranges())
    if tokens <= 0 or (SMALL_MAX < tokens < LARGE_MIN and not middle):
        assert tile is None  # the pair is faster there (or there is nothing to do)
        return
    if not captured and tokens < LARGE_MIN:
        assert tile is None  # an eager call this small is host-bound: the cheaper launch wins
        return
    assert tile is not None
    if tokens <= SMALL_MAX:  # one row tile: every program reads each weight tile once
        assert tile.rows >= tokens
    for v in (tile.rows, tile.cols, tile.depth, tile.warps):
        assert v & (v - 1) == 0  # Triton's block shapes and warp counts are powers of two
    # what the kernel holds: the pipelined x, gate and up tiles in shared memory, and two fp32
    # accumulators of rows x cols spread over the threads (a table entry that cannot run fails)
    assert tile.stages * (tile.rows + 2 * tile.cols) * tile.depth * 2 <= H100_SMEM
    assert 2 * tile.rows * tile.cols // (tile.warps * 32) <= 128


def test_large_buckets_take_the_tile_measured_fastest_there():
    """From 2,048 rows the sweep's winner with the one-dot kernel: 3 stages, groups of 16 row
    tiles (docs/benchmarks.md, session 40), eager or captured. A table that fell back to the
    4-stage, group-8 tile it replaced, or let some large size take another, fails."""
    large = tile_for(LARGE_MIN)
    assert (large.rows, large.cols, large.depth, large.stages, large.warps, large.group) == (
        128, 128, 64, 3, 8, 16,
    )  # fmt: skip
    for tokens in (LARGE_MIN, 3072, 4096, 8192, 40_000):
        assert tile_for(tokens) == large and tile_for(tokens, captured=False) == large


def test_middle_buckets_take_the_kernel_only_where_it_was_measured_faster():
    """Between 128 and 2,048 rows, captured calls take the kernel at the default buckets where
    session 41's sweep measured it faster than the pair (192, 384, 1,536 rows, each with the
    tile measured there) and keep the pair at the others (256, 512, 768, 1,024); eager calls
    there keep the pair (host-bound). A table that let every middle size take the kernel, or
    none, fails."""
    small = tile_for(192)
    assert (small.rows, small.cols, small.depth, small.stages, small.warps, small.group) == (
        64, 64, 64, 4, 4, 8,
    )  # fmt: skip
    mid = tile_for(384)
    assert (mid.rows, mid.cols, mid.depth, mid.stages, mid.warps, mid.group) == (
        128, 128, 64, 4, 8, 8,
    )  # fmt: skip
    assert tile_for(1536) == tile_for(LARGE_MIN)
    for tokens in (256, 512, 768, 1024):
        assert tile_for(tokens) is None, tokens
    for tokens in (192, 384, 1536):
        assert tile_for(tokens, captured=False) is None, tokens


def test_shapes_the_kernel_cannot_take_are_named():
    assert shape_blocker(1536, 8960, 2) is None  # Qwen2.5-1.5B
    assert shape_blocker(256, 768, 2) is None  # the built-in model
    assert shape_blocker(2048, 10944, 2) is None  # DeepSeek-V2-Lite's dense layer
    assert "multiple of 128" in shape_blocker(1000, 8960, 2)
    assert "16-byte aligned" in shape_blocker(1536, 8961, 2)


def test_gate_up_choice_says_why_and_refuses_what_cannot_run():
    auto = choose_gate_up("auto", "cuda", "bfloat16", SM90, None)
    assert auto.name == "triton" and "sm90" in auto.reason
    cpu = choose_gate_up("auto", "cpu", "float32", None, None)
    assert cpu.name == "torch" and "CUDA device" in cpu.reason
    ampere = choose_gate_up("auto", "cuda", "bfloat16", (8, 0), None)
    assert ampere.name == "torch" and "sm80" in ampere.reason and "TMA" in ampere.reason
    blackwell = choose_gate_up("auto", "cuda", "bfloat16", (10, 0), None)
    assert blackwell.name == "torch" and "--gate-up-kernel triton" in blackwell.reason
    assert choose_gate_up("triton", "cuda", "bfloat16", (10, 0), None).name == "triton"
    fp32 = choose_gate_up("auto", "cuda", "float32", SM90, None)
    assert fp32.name == "torch" and "float32" in fp32.reason
    missing = choose_gate_up("auto", "cuda", "bfloat16", SM90, "ImportError: no triton")
    assert missing.name == "torch" and "triton is not importable" in missing.reason
    assert "asked for" in choose_gate_up("torch", "cuda", "bfloat16", SM90, None).reason
    misfit = choose_gate_up("auto", "cuda", "bfloat16", SM90, None, shape_blocker(1000, 8960, 2))
    assert misfit.name == "torch" and "hidden size 1000 is not a multiple of 128" in misfit.reason
    with pytest.raises(ConfigError, match=r"--gate-up-kernel triton cannot run here: .*sm80"):
        choose_gate_up("triton", "cuda", "bfloat16", (8, 0), None)
    with pytest.raises(ConfigError, match=r"supported: \['auto', 'triton', 'torch'\]"):
        EngineConfig(gate_up_kernel="cutlass")


def test_the_flag_reaches_the_config_and_server_info_reports_the_choice():
    assert engine_flags("--gate-up-kernel", "torch").gate_up_kernel == "torch"
    with pytest.raises(SystemExit):
        engine_flags("--gate-up-kernel", "cublas")
    info = cpu_server_info()
    assert info["gate_up_kernel"]["name"] == "torch"
    assert "CUDA device" in info["gate_up_kernel"]["reason"]


# ---- CUDA ---------------------------------------------------------------------------------------
def _needs_sm90() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the fused gate_up kernel needs sm90 (TMA)")
    pytest.importorskip("triton", reason="needs triton")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 silu(x Wg^T) * (x Wu^T)."""
    g, u = (x.float() @ w.float().T).chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


# bf16 output: one rounding is 2^-8 of the value; the pair rounds the GEMM output too
FUSED_TOL = 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter", [(1536, 8960), (256, 200)])
@pytest.mark.parametrize(
    "tokens", [1, 16, 37, 100, 128, 129, 192, 300, 1000, 1536, 2048, 2051, 4097]
)
def test_fused_gate_up_matches_float32_and_runs_where_the_policy_says(tokens, hidden, inter):
    """The kernel against a float32 reference, with an intermediate size that no column tile
    divides (200) and token counts that no row tile divides: a kernel that swapped gate and up,
    dropped a partial tile or misread the up rows fails. Then the service's call: eager, the
    kernel from 2,048 tokens and the pair below (bit for bit); captured into a graph, the kernel
    wherever the policy has a tile, and the replay gives the kernel's bits."""
    _needs_sm90()
    from service.model import gate_up_triton as gt

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g, device=dev).to(torch.bfloat16)
    w = (torch.randn(2 * inter, hidden, generator=g, device=dev) / hidden**0.5).to(torch.bfloat16)
    tile = tile_for(tokens) or tile_for(LARGE_MIN)  # the kernel at every size, policy or not
    kernel = gt.fused(x, w, tile)
    assert kernel.shape == (tokens, inter) and kernel.dtype == torch.bfloat16
    assert rel_err(kernel, reference(x, w)) < FUSED_TOL
    gate, up = torch.nn.functional.linear(x, w).chunk(2, dim=-1)
    pair = torch.nn.functional.silu(gate) * up
    assert rel_err(pair, reference(x, w)) < FUSED_TOL
    eager = gt.gate_up_silu(x, w, flashinfer=False)
    assert torch.equal(eager, kernel if tokens >= LARGE_MIN else pair)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gt.gate_up_silu(x, w, flashinfer=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, gt.fused(x, w, tile_for(tokens)) if tile_for(tokens) else pair)


@pytest.mark.gpu
def test_the_op_in_a_compiled_function_decides_by_rows_at_run_time():
    """tc_piecewise's pieces trace with symbolic token counts: the op must take the kernel or the
    pair per call, bit-identical to a direct call at each size."""
    _needs_sm90()
    from service.model.gate_up_triton import gate_up_silu, gate_up_silu_impl

    dev = torch.device("cuda")
    w = (torch.randn(2 * 512, 256, device=dev) / 16).to(torch.bfloat16)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: gate_up_silu(x, w, False) * 2, dynamic=True, fullgraph=True)
    for tokens in (16, 256, 2048, 64):
        x = torch.randn(tokens, 256, device=dev).to(torch.bfloat16)
        assert torch.equal(fn(x), gate_up_silu_impl(x, w, False) * 2), tokens


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["breakable", "tc_piecewise", "full"])
def test_the_model_with_the_fused_kernel_matches_the_model_without_it(backend, monkeypatch):
    """The built-in model in bf16, eager and replayed, with the fused kernel against the same
    weights with the pair: logits within the stated tolerance, the fused kernel really ran
    in the captured graphs, and the replay within the same tolerance of eager (eager runs the
    batch's 48 rows with the pair, the graph its 64-row bucket with the kernel)."""
    _needs_sm90()
    from service.buckets import decide_replay
    from service.model import gate_up_triton as gt
    from tests.batches import live_batch

    def engine(kind: str) -> Engine:
        return Engine(
            EngineConfig(device="cuda", dtype="bfloat16", context_length=512,
                         max_running_requests=8, chunked_prefill_size=256,
                         kv_cache_memory_bytes=32 << 20, gate_up_kernel=kind,
                         graph=GraphConfig(backend=backend, buckets=(64, 256))),
        )  # fmt: skip

    rows = []
    real = gt.fused
    monkeypatch.setattr(gt, "fused", lambda *a: rows.append(a[0].shape[0]) or real(*a))
    fused, pair = engine("triton"), engine("torch")
    assert fused.resolved.limits.gate_up.name == "triton"
    assert 64 in rows  # captured: the 64-token bucket's graphs launch the fused kernel
    outs = []
    for e in (fused, pair):
        w = e.executor.worker
        batch = live_batch(w, (20, 17, 11), seed=3)
        hit = decide_replay(e.resolved.plan, 48, 3)
        assert hit.hit and hit.bucket == 64
        with torch.inference_mode():
            outs.append((w.eager_runner.run(batch, hit).float(),
                         w.runner.run(batch, hit).float()))  # fmt: skip
    (f_eager, f_replay), (p_eager, p_replay) = outs
    assert 48 not in rows  # an eager call this small keeps the pair ...
    assert torch.equal(f_eager, p_eager)  # ... so both engines compute the same bits
    scale = p_eager.abs().max().item()
    assert (f_replay - p_replay).abs().max().item() < 2e-2 * scale
    assert (f_replay - f_eager).abs().max().item() < 2e-2 * scale
    # the pair's own replay differs too where kernels differ (tc_piecewise: inductor's compiled
    # reference against FlashInfer's eager kernels; 1.2e-2 of the scale on the H200)
    assert (p_replay - p_eager).abs().max().item() < 2e-2 * scale
