"""o_proj and down split over K, their float32 partials summed by the add-RMSNorm after them: the
policy, which ranks may choose the kernel and why, what /server_info says, the model's route on
CPU (the torch reference of the summing kernel behind the real slicing); on CUDA (gpu marker)
the Triton kernel against that reference and against cuBLAS + the norm, and the model with it
against the model without it, eager and replayed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn import functional as F

from service.buckets import decide_replay
from service.config import EngineConfig, GraphConfig
from service.engine import Engine
from service.errors import ConfigError
from service.model import splitk
from service.model.kernels import Kernels
from service.model.splitk_policy import MAX_ROWS, MIN_ROWS, slices
from service.ranks.select import choose_splitk_norm
from tests.batches import cpu_server_info, engine_flags, live_batch, small_engine

QWEN_H, QWEN_I = 1536, 8960  # Qwen2.5-1.5B: o_proj (H, H), down (H, I); the measured shapes


def test_the_policy_splits_where_it_was_measured_faster():
    """docs/benchmarks.md, session 36 (benchmarks/splitk_norm.py on the H200)."""
    down = {m: slices(m, QWEN_I, QWEN_H) for m in (1, 15, 16, 64, 256, 512, 1024, 2048)}
    assert down == {1: 1, 15: 1, 16: 4, 64: 4, 256: 4, 512: 2, 1024: 1, 2048: 1}
    o_proj = {m: slices(m, QWEN_H, QWEN_H) for m in (1, 8, 16, 256, 257, 512, 1024)}
    assert o_proj == {1: 1, 8: 1, 16: 2, 256: 2, 257: 1, 512: 1, 1024: 1}


@given(
    st.integers(min_value=-1, max_value=100_000),
    st.integers(min_value=1, max_value=40_000),
    st.integers(min_value=1, max_value=40_000),
)
def test_slices_always_divide_k_and_stop_past_the_largest_measured_rows(rows, k, n):
    s = slices(rows, k, n)
    assert s in (1, 2, 4) and k % s == 0
    if rows < MIN_ROWS or rows > MAX_ROWS:  # only where measured faster
        assert s == 1


@pytest.mark.parametrize("s", [2, 4])
def test_partials_sum_to_the_projection_without_copying_a_strided_input(s):
    """x is a column slice of a wider buffer (row stride past its width), as a segment's
    attention output can be: the slices' products sum to F.linear's (float32), and a weight the
    slicing cannot view, or a K the slices do not divide, is refused instead of miscomputed."""
    g = torch.Generator().manual_seed(s)
    wide = torch.randn(37, 96 + 40, generator=g)
    x = wide[:, 8:104]  # (37, 96), row stride 136
    w = torch.randn(48, 96, generator=g)
    assert splitk.fits(x, w, s)
    parts = splitk.partials(x, w, s)
    assert parts.shape == (s, 37, 48) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(0), F.linear(x, w), rtol=1e-5, atol=1e-5)
    # each slice is its own K range (a view that read the wrong columns would still sum right
    # only by accident: check the first slice alone)
    kc = 96 // s
    torch.testing.assert_close(parts[0], F.linear(x[:, :kc], w[:, :kc]), rtol=1e-5, atol=1e-5)
    assert not splitk.fits(x, w.t().contiguous().t(), s)  # a transposed weight
    assert not splitk.fits(x, w[:, :90], s)  # K mismatch
    assert not splitk.fits(torch.randn(4, 90), torch.randn(8, 90), 4)  # 4 does not divide 90


def test_the_reference_sum_norm_matches_the_projection_then_the_add_norm():
    """float32: summing the partials inside the norm gives the projection-then-add-norm result,
    and the residual stream moves on in place."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(20, 64, generator=g), torch.randn(32, 64, generator=g)
    res = torch.randn(20, 32, generator=g)
    gamma = torch.rand(32, generator=g) + 0.5
    want_h, want_r = Kernels().add_rms_norm(F.linear(x, w), res.clone(), gamma, 1e-6)
    mine = res.clone()
    got_h, got_r = splitk.add_rms_norm(splitk.partials(x, w, 4), mine, gamma, 1e-6)
    assert got_r is mine
    torch.testing.assert_close(got_r, want_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)


def test_who_may_choose_the_kernel_and_why():
    sm90 = choose_splitk_norm("auto", "cuda", "bfloat16", (9, 0), 1, None)
    assert sm90.name == "triton" and "sm90" in sm90.reason
    cpu = choose_splitk_norm("auto", "cpu", "float32", None, 1, None)
    assert cpu.name == "torch" and "CUDA device" in cpu.reason
    tp2 = choose_splitk_norm("auto", "cuda", "bfloat16", (9, 0), 2, None)
    assert tp2.name == "torch" and "--tp 2" in tp2.reason and "all-reduced" in tp2.reason
    missing = choose_splitk_norm("auto", "cuda", "bfloat16", (9, 0), 1, "ImportError: x")
    assert missing.name == "torch" and "triton is not importable" in missing.reason
    fp32 = choose_splitk_norm("auto", "cuda", "float32", (9, 0), 1, None)
    assert fp32.name == "torch" and "float32" in fp32.reason
    blackwell = choose_splitk_norm("auto", "cuda", "bfloat16", (10, 0), 1, None)
    assert blackwell.name == "torch" and "--splitk-norm-kernel triton" in blackwell.reason
    asked = choose_splitk_norm("triton", "cuda", "bfloat16", (10, 0), 1, None)
    assert asked.name == "triton" and "asked for" in asked.reason
    with pytest.raises(ConfigError, match=r"--splitk-norm-kernel triton cannot run here: .*tp 4"):
        choose_splitk_norm("triton", "cuda", "bfloat16", (9, 0), 4, None)
    with pytest.raises(ConfigError, match="unsupported splitk_norm kernel 'cutlass'"):
        EngineConfig(splitk_norm_kernel="cutlass")
    assert engine_flags("--splitk-norm-kernel", "torch").splitk_norm_kernel == "torch"
    with pytest.raises(SystemExit):
        engine_flags("--splitk-norm-kernel", "cublas")


def test_server_info_reports_the_choice_with_its_reason():
    info = cpu_server_info()
    assert info["splitk_norm_kernel"]["name"] == "torch"
    assert "CUDA device" in info["splitk_norm_kernel"]["reason"]


def recording_kernels(calls: list[tuple[int, ...]], monkeypatch):
    """A stand-in for service.ranks.startup.make_kernels: the torch kernels, with the reference
    summing norm behind the real split-K route; each sum's partials shape is appended to calls,
    whichever route summed them (Kernels.add_rms_norm, or the op compiled pieces call)."""
    reference = splitk.add_rms_norm

    def recorded(parts, *a):
        calls.append(tuple(parts.shape))
        return reference(parts, *a)

    monkeypatch.setattr(splitk, "add_rms_norm", recorded)

    def make(name, fused_gate_up=False, rope_store=False, splitk_norm=False) -> Kernels:
        k = Kernels()
        k._splitk_norm = lambda *a: splitk.add_rms_norm(*a)
        return k

    return make


@pytest.mark.parametrize("backend", ["eager", "full", "breakable", "tc_piecewise"])
def test_the_model_routes_o_proj_and_down_through_the_summing_norm(backend, monkeypatch):
    """CPU, float32, the torch reference standing in for the Triton kernel behind the real
    slicing: the logits and the cache match the plain route's, and every layer's o_proj and
    down really went through the sum (2 K-slices of the built-in's K = 256 and 768, at the
    batch's or the bucket's rows). A slicing that read the wrong columns, a norm that dropped a
    partial or forgot the residual, or partials reaching a consumer that wanted a tensor fail
    here. tc_piecewise's compiled pieces, traced once for every bucket, sum them in one op
    that splits at each bucket's rows (service.model.splitk_op)."""
    import service.ranks.startup as startup

    calls: list[tuple[int, ...]] = []
    plain = small_engine(backend, "cpu")
    monkeypatch.setattr(startup, "make_kernels", recording_kernels(calls, monkeypatch))
    routed = small_engine(backend, "cpu")
    at_capture = list(calls)
    layers = len(routed.executor.worker.model.layers)
    outs = []
    for e in (plain, routed):
        w = e.executor.worker
        batch = live_batch(w, (20, 17, 11), seed=3)
        hit = decide_replay(e.resolved.plan, 48, 3)
        calls.clear()
        with torch.inference_mode():
            runner = w.eager_runner if backend == "eager" else w.runner
            got = runner.run(batch, hit).clone()
            outs.append((got, torch.stack([t.clone() for t in w.kv.kv])))
    (p_out, p_cache), (r_out, r_cache) = outs
    assert (p_out - r_out).abs().max().item() < 1e-4 * p_out.abs().max().item()
    assert (p_cache - r_cache).abs().max().item() < 1e-4 * p_cache.abs().max().item()
    if backend == "eager":  # o_proj's and down's sums of every layer, at the batch's rows
        assert calls.count((2, 48, 256)) == 2 * layers, calls
    else:
        # on CPU a capture records the aten ops of one call (service.ranks.runners.op_trace) and
        # a replay re-runs them: the sums ran at capture (and at its warm-up call, where the
        # runner makes one), every layer, each bucket's rows
        for bucket in (64, 256):
            n = at_capture.count((2, bucket, 256))
            assert n and n % (2 * layers) == 0, at_capture
    if backend == "tc_piecewise":
        _assert_pieces_fill_their_hand_over_buffers(routed.executor.worker.runner, layers)


def _assert_pieces_fill_their_hand_over_buffers(runner, layers: int) -> None:
    """Every piece between two layers hands its new residual over as the buffer the op filled:
    no fresh tensor left among its outputs to copy (a call of the op that the hand-over did not
    recognise would leave one)."""
    from service.ranks.runners.tc_piecewise.handover import redirect_outputs

    def fresh(graph) -> list:
        out = graph.output_node().args[0]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [o for o in outs if getattr(o, "target", None) is torch.empty_like]

    handing = 0
    for piece in runner.pieces:
        if not fresh(piece.sub.graph):  # the last piece returns the final norm alone
            continue
        red = redirect_outputs(piece.sub)
        assert red is not None and not fresh(red.module.graph), piece.sub.code
        handing += 1
    assert handing == layers - 1, handing


def test_decode_steps_split_from_16_requests_and_not_below(monkeypatch):
    """CPU, float32, eager decode with the torch reference behind the real slicing: 16 requests
    decode through the sum (their steps' 16 rows, every layer's o_proj and down), 4 requests
    through cuBLAS's projection and the plain norm (the policy measured nothing below 16 rows);
    the generated tokens are the plain route's either way."""
    import service.ranks.startup as startup
    from service.sampling import SamplingParams

    calls: list[tuple[int, ...]] = []

    def generate(n: int) -> tuple[list[list[int]], int]:
        """n requests' generated ids, and the sums a decode step makes (o_proj, down a layer)"""
        e = Engine(EngineConfig(device="cpu", context_length=128, max_running_requests=16,
                                kv_cache_memory_bytes=16 << 20,
                                graph=GraphConfig(backend="eager")))  # fmt: skip
        prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + i % 3)] for i in range(n)]
        got = e.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
        return [o.output_ids for o in got], 2 * len(e.executor.worker.model.layers)

    plain = {n: generate(n)[0] for n in (16, 4)}
    monkeypatch.setattr(startup, "make_kernels", recording_kernels(calls, monkeypatch))
    for n in (16, 4):
        calls.clear()
        ids, sums_a_step = generate(n)
        assert ids == plain[n]
        decode = [c for c in calls if c[1] == n]
        if n == 16:  # two decode steps after the prefill's first token
            assert len(decode) == 2 * sums_a_step, calls
        else:
            assert not decode and all(rows >= MIN_ROWS for _, rows, _ in calls), calls


# ---- CUDA ---------------------------------------------------------------------------------------
def _needs_triton() -> None:
    pytest.importorskip("triton", reason="needs triton")


# bf16 outputs: one rounding is 2^-8 of the value
TOL = 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 37, 256, 512])
@pytest.mark.parametrize("n,k,s", [(QWEN_H, QWEN_I, 4), (QWEN_H, QWEN_H, 2), (200, 96, 2)])
def test_the_kernel_matches_the_reference_and_cublas_then_the_norm(tokens, n, k, s):
    """The Triton sum + add + norm against its torch reference on the same partials (the same
    arithmetic: within one bf16 rounding), and against cuBLAS's projection then the torch
    add-norm (within the stated tolerance), with an N no power of two (200: masked columns) and
    a residual that is a column slice of a wider buffer."""
    _needs_triton()
    from service.model import splitk_triton

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(tokens * 7 + s)
    x = torch.randn(tokens, k, generator=g, device=dev).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=dev) / k**0.5).to(torch.bfloat16)
    wide = torch.randn(tokens, n + 64, generator=g, device=dev).to(torch.bfloat16)
    gamma = (torch.rand(n, generator=g, device=dev) + 0.5).to(torch.bfloat16)
    parts = splitk.partials(x, w, s)
    ref_res = wide[:, 32 : 32 + n].clone()
    ref_h, _ = splitk.add_rms_norm(parts, ref_res, gamma, 1e-6)
    kern_buf = wide.clone()
    kern_res = kern_buf[:, 32 : 32 + n]
    got_h, got_r = splitk_triton.add_rms_norm(parts, kern_res, gamma, 1e-6)
    assert got_r.data_ptr() == kern_res.data_ptr()
    assert torch.equal(kern_buf[:, :32], wide[:, :32])  # the columns around it untouched
    assert torch.equal(kern_buf[:, 32 + n :], wide[:, 32 + n :])
    torch.testing.assert_close(got_r, ref_res, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(got_h, ref_h, rtol=2**-7, atol=2**-7)
    want_h, want_r = Kernels().add_rms_norm(F.linear(x, w), wide[:, 32 : 32 + n].clone(), gamma,
                                            1e-6)  # fmt: skip
    scale = want_h.float().abs().max().item()
    assert (got_h.float() - want_h.float()).abs().max().item() < TOL * scale
    assert (got_r.float() - want_r.float()).abs().max().item() < TOL * want_r.float().abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16, 256, 512, 1024])
def test_the_compiled_pieces_op_matches_cublas_then_the_norm(tokens):
    """service.model.splitk_op's op on CUDA, at token counts the policy splits (16, 256: 4
    slices of down's K; 512: 2) and does not (1,024: cuBLAS's projection, then the same
    kernel): the new residual and the norm within the stated tolerance of cuBLAS then the torch
    add-norm, written into the tensor given for the residual, the input residual untouched."""
    _needs_triton()
    from service.model import splitk_op

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(tokens)
    x = torch.randn(tokens, QWEN_I, generator=g, device=dev).to(torch.bfloat16)
    w = (torch.randn(QWEN_H, QWEN_I, generator=g, device=dev) / QWEN_I**0.5).to(torch.bfloat16)
    res = torch.randn(tokens, QWEN_H, generator=g, device=dev).to(torch.bfloat16)
    gamma = (torch.rand(QWEN_H, generator=g, device=dev) + 0.5).to(torch.bfloat16)
    before = res.clone()
    new = torch.full_like(res, float("nan"))
    got_h = splitk_op.row_linear_add_rms_norm(x, w, res, gamma, 1e-6, new)
    assert torch.equal(res, before)
    want_h, want_r = Kernels().add_rms_norm(F.linear(x, w), before.clone(), gamma, 1e-6)
    assert (new.float() - want_r.float()).abs().max().item() < TOL * want_r.float().abs().max()
    scale = want_h.float().abs().max().item()
    assert (got_h.float() - want_h.float()).abs().max().item() < TOL * scale


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["breakable", "tc_piecewise", "full"])
def test_the_model_with_the_kernel_matches_the_model_without_it(backend, monkeypatch):
    """The built-in model in bf16, eager and replayed, with the split-K kernel against the same
    weights without it: logits within the stated tolerance, the kernel really ran in the
    captured graphs (full, breakable: the model's route; tc_piecewise: the op its compiled
    pieces call, service.model.splitk_op), and each replay within the same tolerance of its
    eager."""
    _needs_triton()
    from service.model import splitk_triton

    rows: list[int] = []
    real = splitk_triton.add_rms_norm
    monkeypatch.setattr(splitk_triton, "add_rms_norm",
                        lambda p, *a: rows.append(p.shape[1]) or real(p, *a))  # fmt: skip
    on = small_engine(backend, "cuda", splitk_norm_kernel="triton")
    off = small_engine(backend, "cuda", splitk_norm_kernel="torch")
    assert on.resolved.limits.splitk_norm.name == "triton"
    assert off.resolved.limits.splitk_norm.name == "torch"
    captured = list(rows)
    assert 64 in captured and 256 in captured
    outs = []
    for e in (on, off):
        w = e.executor.worker
        batch = live_batch(w, (20, 17, 11), seed=3)
        hit = decide_replay(e.resolved.plan, 48, 3)
        with torch.inference_mode():
            outs.append((w.eager_runner.run(batch, hit).float(),
                         w.runner.run(batch, hit).float()))  # fmt: skip
    (on_eager, on_replay), (off_eager, off_replay) = outs
    assert 48 in rows  # the eager call summed its 48 rows' partials
    scale = off_eager.abs().max().item()
    assert (on_eager - off_eager).abs().max().item() < 2e-2 * scale
    assert (on_replay - off_replay).abs().max().item() < 2e-2 * scale
    assert (on_replay - on_eager).abs().max().item() < 2e-2 * scale


@pytest.mark.parametrize("backend", ["eager", "breakable", "tc_piecewise"])
def test_deepseeks_dense_layer_routes_down_through_the_summing_norm(backend, tmp_path, monkeypatch):
    """DeepSeek V2 (tiny, float32, CPU): its dense layer's down goes through the sum and the
    next layer's add-norm takes the partials (MLA's o_proj and the MoE layers stay as they
    are); generated tokens and prefill logits match the plain route's."""
    import service.ranks.startup as startup
    from service.sampling import SamplingParams
    from tests.hf_models import make_deepseek_v2

    make_deepseek_v2(tmp_path)
    calls: list[tuple[int, ...]] = []

    def engine() -> Engine:
        e = Engine(EngineConfig(model_path=str(tmp_path), dtype="float32", device="cpu",
                                context_length=128, max_running_requests=4,
                                kv_cache_memory_bytes=8 << 20,
                                graph=GraphConfig(backend=backend, buckets=(16, 64))))  # fmt: skip
        e.return_logits = True
        return e

    outs = []
    for routed in (False, True):
        if routed:
            monkeypatch.setattr(startup, "make_kernels", recording_kernels(calls, monkeypatch))
        calls.clear()
        e = engine()  # a graph backend captures its buckets here, through the route
        greedy = SamplingParams(max_new_tokens=3, ignore_eos=True)
        got = e.generate([list(range(3, 43)), [9, 4, 1, 7]], greedy)
        prefill = [r.logits for b, r in e.last_logits if b.command.is_prefill]
        outs.append(([o.output_ids for o in got], prefill, list(calls)))
    (p_ids, p_logits, _), (r_ids, r_logits, r_calls) = outs
    assert r_ids == p_ids
    for p, r in zip(p_logits, r_logits, strict=True):
        assert (p - r).abs().max().item() < 1e-4 * p.abs().max().item()
    # the dense layer's down (K 96 -> 2 slices of 48, N 64): eager prefill runs the batch's 44
    # rows through the route, a graph backend's capture its buckets' 16 and 64 (tc_piecewise's
    # through the op its compiled pieces call); the decode steps' 2 rows are below the policy's
    # measured sizes and stay plain
    if backend == "eager":
        assert (2, 44, 64) in r_calls
    else:
        assert (2, 16, 64) in r_calls and (2, 64, 64) in r_calls
    assert all(rows >= MIN_ROWS for _, rows, _ in r_calls)
