"""Rotary on q and k and the K/V store as one Triton kernel: which ranks may choose it and why,
what /server_info says, the model's route through the attention's KV target (on CPU, with the
reference); on CUDA (gpu marker) the kernel against the torch reference and the model with it
against the model without it, eager and replayed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from service.buckets import decide_replay
from service.config import EngineConfig
from service.errors import ConfigError
from service.model import out_twins
from service.model.kernels import Kernels
from service.model.rope_store_policy import block_tokens
from service.ranks.select import choose_rope_store
from tests.batches import cpu_server_info, engine_flags, live_batch, small_engine


@given(st.integers(min_value=1, max_value=100_000))
def test_a_block_is_a_power_of_two_and_small_batches_get_small_ones(tokens):
    bt = block_tokens(tokens)
    assert bt & (bt - 1) == 0
    assert bt <= max(16, tokens)  # a small batch never leaves most of its one block empty


def test_the_choice_says_why_and_refuses_what_cannot_run():
    auto = choose_rope_store("auto", "cuda", "bfloat16", 128, "flashinfer", None)
    assert auto.name == "triton" and "triton installed" in auto.reason
    cpu = choose_rope_store("auto", "cpu", "float32", 128, "torch", None)
    assert cpu.name == "torch" and "CUDA device" in cpu.reason
    torch_kernels = choose_rope_store("auto", "cuda", "bfloat16", 128, "torch", None)
    assert torch_kernels.name == "torch" and "--fused-kernels flashinfer" in torch_kernels.reason
    mla = choose_rope_store("auto", "cuda", "bfloat16", 128, "flashinfer", None, mla=True)
    assert mla.name == "torch" and "MLA" in mla.reason
    missing = choose_rope_store("auto", "cuda", "bfloat16", 128, "flashinfer", "ImportError: x")
    assert missing.name == "torch" and "triton is not importable" in missing.reason
    odd = choose_rope_store("auto", "cuda", "bfloat16", 96, "flashinfer", None)
    assert odd.name == "torch" and "power of two" in odd.reason
    fp32 = choose_rope_store("auto", "cuda", "float32", 128, "flashinfer", None)
    assert fp32.name == "torch" and "float32" in fp32.reason
    assert (
        "asked for"
        in choose_rope_store("torch", "cuda", "bfloat16", 128, "flashinfer", None).reason
    )
    with pytest.raises(ConfigError, match=r"--rope-store-kernel triton cannot run here: .*CUDA"):
        choose_rope_store("triton", "cpu", "float32", 128, "torch", None)
    with pytest.raises(ConfigError, match=r"supported: \['auto', 'triton', 'torch'\]"):
        EngineConfig(rope_store_kernel="cuda")


def test_the_flag_reaches_the_config_and_server_info_reports_the_choice():
    assert engine_flags("--rope-store-kernel", "torch").rope_store_kernel == "torch"
    with pytest.raises(SystemExit):
        engine_flags("--rope-store-kernel", "cuda")
    info = cpu_server_info()
    assert info["rope_store_kernel"]["name"] == "torch"
    assert "CUDA device" in info["rope_store_kernel"]["reason"]


def test_ranks_that_chose_different_kernels_are_refused_with_the_flag_to_pass():
    """Every shared start-up choice, the rotary + store kernel among them: ranks that differ
    are named with their reasons and the flag that fixes it; ranks that agree take the smallest
    pool and rank 0's choices."""
    from dataclasses import replace

    from service.rank_info import BackendChoice, RankInfo, agree_rank_infos

    same = BackendChoice("torch", "asked for")
    base = RankInfo(rank=0, device="cuda:0", dtype="bfloat16", context_length=2048,
                    max_running_requests=8, num_kv_slots=1000, chunked_prefill_size=2048,
                    vocab_size=100, eos_token_ids=(1,), model_dir="m", architecture="a",
                    attention=same, kernels=same, gate_up=same, rope_store=same,
                    splitk_norm=same, prefill_schedule=same)  # fmt: skip
    other = replace(base, rank=1, num_kv_slots=900)
    assert agree_rank_infos([base, other]) == replace(base, num_kv_slots=900)
    for field, what, flag in [
        ("attention", "attention backends", "--attention-backend"),
        ("kernels", "fused kernels", "--fused-kernels"),
        ("gate_up", "gate_up kernels", "--gate-up-kernel"),
        ("rope_store", "rope_store kernels", "--rope-store-kernel"),
        ("splitk_norm", "splitk_norm kernels", "--splitk-norm-kernel"),
        ("prefill_schedule", "prefill schedules", "--prefill-schedule"),
    ]:
        odd = replace(other, **{field: BackendChoice("triton", "auto: x")})
        with pytest.raises(ConfigError) as err:
            agree_rank_infos([base, odd])
        assert str(err.value) == (f"ranks chose different {what}: rank 0: torch (asked for), "
                                  f"rank 1: triton (auto: x); pass {flag} explicitly")  # fmt: skip


@pytest.mark.parametrize("backend", ["eager", "full", "breakable", "tc_piecewise"])
def test_the_model_stores_through_the_kv_target_where_the_kernels_say_so(backend, monkeypatch):
    """CPU, with the reference (rotary, then the bound attention's own store) behind the KV
    target: the same logits and the same cache bit for bit as the plain route, and the route
    really ran (a target whose cache or slots were wrong, a layer that stored twice or not at all,
    would change the cache or the next prefill's logits). tc_piecewise's compiled pieces keep the
    deferred store: their attention gives no target."""
    import service.ranks.startup as startup

    calls: list[int] = []

    class Spy(Kernels):
        def rope_qkv_store(self, ctx, qkv, sizes, head_dim, target, bias=None):
            calls.append(target.loc.shape[0])
            assert target.cache.shape[1:] == (2, sizes[1] // head_dim, head_dim)
            return super().rope_qkv_store(ctx, qkv, sizes, head_dim, target, bias)

    def spy_kernels(name, fused_gate_up=False, rope_store=False, splitk_norm=False):
        k = Spy()
        k._rope_store = "reference"  # any chosen kernel routes through the target
        return k

    plain = small_engine(backend, "cpu")
    monkeypatch.setattr(startup, "make_kernels", spy_kernels)
    routed = small_engine(backend, "cpu")
    assert type(routed.executor.worker.model.kernels) is Spy
    outs = []
    for e in (plain, routed):
        w = e.executor.worker
        first = live_batch(w, (20, 17, 11), seed=3)
        hit = decide_replay(e.resolved.plan, 48, 3)
        with torch.inference_mode():
            runner = w.eager_runner if backend == "eager" else w.runner
            got = runner.run(first, hit).clone()
            cache = torch.stack([t.clone() for t in w.kv.kv])
        outs.append((got, cache))
    (p_out, p_cache), (r_out, r_cache) = outs
    assert torch.equal(p_out, r_out)
    assert torch.equal(p_cache, r_cache) and p_cache.abs().sum() > 0
    if backend == "tc_piecewise":
        assert calls == [] or all(n > 0 for n in calls)  # eager warm-up calls only
    else:
        assert calls and set(calls) <= {48, 64, 256}  # eager rows, or a bucket's padded rows


@pytest.mark.parametrize("backend", ["eager", "breakable"])
def test_qkvs_bias_left_to_the_store_kernel_is_added_once(backend, monkeypatch, tmp_path):
    """A model whose qkv projection has a bias (Qwen2's), on CPU: where the kernels say the
    rotary + store kernel adds the bias, the GEMM runs without it and every layer hands it to
    that kernel (here the reference, which adds it first); the logits and the cache match the
    plain route's (the GEMM's epilogue adds it), float32 within rounding. A bias added twice,
    or by neither, moves them by far more (the biases are made large for that)."""
    import json

    import service.ranks.startup as startup
    from service.model.builtin import BUILTIN_CONFIG

    model_dir = tmp_path / "biased"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**BUILTIN_CONFIG, "attention_bias": True}))
    model = {"model_path": str(model_dir), "load_format": "random"}
    given: list[bool] = []

    class Folding(Kernels):
        def rope_adds_bias(self, rows):
            return True

        def rope_qkv_store(self, ctx, qkv, sizes, head_dim, target, bias=None):
            given.append(bias is not None)
            return super().rope_qkv_store(ctx, qkv, sizes, head_dim, target, bias)

    def folding_kernels(name, fused_gate_up=False, rope_store=False, splitk_norm=False):
        k = Folding()
        k._rope_store = "reference"  # any chosen kernel routes through the target
        return k

    plain = small_engine(backend, "cpu", **model)
    monkeypatch.setattr(startup, "make_kernels", folding_kernels)
    routed = small_engine(backend, "cpu", **model)
    g = torch.Generator().manual_seed(5)
    for e in (plain, routed):
        g.manual_seed(5)
        for layer in e.executor.worker.model.layers:
            layer.self_attn.qkv_proj.bias.copy_(torch.randn(layer.self_attn.qkv_proj.bias.shape,
                                                            generator=g))  # fmt: skip
    outs = []
    for e in (plain, routed):
        w = e.executor.worker
        batch = live_batch(w, (20, 17, 11), seed=3)
        hit = decide_replay(e.resolved.plan, 48, 3)
        with torch.inference_mode():
            for t in w.kv.kv:
                t.zero_()
            runner = w.eager_runner if backend == "eager" else w.runner
            outs.append((runner.run(batch, hit).clone(), torch.stack([t.clone() for t in w.kv.kv])))
    (p_out, p_cache), (r_out, r_cache) = outs
    assert given and all(given)  # every layer handed the bias over
    assert (p_out - r_out).abs().max().item() < 1e-4 * p_out.abs().max().item()
    assert (p_cache - r_cache).abs().max().item() < 1e-4 * p_cache.abs().max().item()
    # the test can fail: the same run with the bias dropped is far off
    w = routed.executor.worker
    for layer in w.model.layers:
        layer.self_attn.qkv_proj.bias.zero_()
    with torch.inference_mode():
        runner = w.eager_runner if backend == "eager" else w.runner
        dropped = runner.run(live_batch(w, (20, 17, 11), seed=3), decide_replay(
            routed.resolved.plan, 48, 3)).clone()  # fmt: skip
    assert (p_out - dropped).abs().max().item() > 1e-2 * p_out.abs().max().item()


# A stand-in for service.model.rope_store_triton on CPU (triton is CUDA-only): the same contract
# computed by the torch reference, so the routes around the kernel (the eager call, and the op in
# tc_piecewise's compiled pieces) run here under the real torch.compile.
_op_calls: list[int] = []


def _cpu_rope_store(qkv, heads, head_dim, positions, table, kv, loc, out=None, block=None,
                    bias=None):  # fmt: skip
    from service.model.kernels import Kernels
    from service.ranks.kv_pool import store_entries

    if bias is not None:  # the kernel's contract: the projection's bias added first
        qkv.add_(bias)

    hq, hkv = heads
    t, d = qkv.shape[0], head_dim
    dst = qkv if out is None else out
    if out is not None:
        out.copy_(qkv[:, : (hq + 2 * hkv) * d])
    q, k = Kernels().rope(Kernels().rope_context(positions, table),
                          qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d], d)  # fmt: skip
    dst[:, : hq * d], dst[:, hq * d : (hq + hkv) * d] = q, k
    k3 = dst[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    v3 = dst[:, (hq + hkv) * d : (hq + 2 * hkv) * d].reshape(t, hkv, d)
    store_entries(kv, loc, k3, v3)


@torch.library.custom_op("capture_service_test::rope_store_qkv", mutates_args=())
def _cpu_rope_store_op(
    qkv: torch.Tensor, heads_q: int, heads_kv: int, head_dim: int, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, kv: torch.Tensor, loc: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    _op_calls.append(qkv.shape[0])
    out = qkv.new_empty(qkv.shape[0], (heads_q + 2 * heads_kv) * head_dim)
    _cpu_rope_store(qkv, (heads_q, heads_kv), head_dim, positions, cos_sin_cache, kv, loc, out)
    return out


@_cpu_rope_store_op.register_fake
def _(qkv, heads_q, heads_kv, head_dim, positions, cos_sin_cache, kv, loc):
    return qkv.new_empty(qkv.shape[0], (heads_q + 2 * heads_kv) * head_dim)


_into_calls: list[int] = []


@torch.library.custom_op("capture_service_test::rope_store_qkv_into", mutates_args=("out",))
def _cpu_rope_store_into_op(
    qkv: torch.Tensor, heads_q: int, heads_kv: int, head_dim: int, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, kv: torch.Tensor, loc: torch.Tensor, out: torch.Tensor,
) -> None:  # fmt: skip
    _into_calls.append(out.data_ptr())
    _cpu_rope_store(qkv, (heads_q, heads_kv), head_dim, positions, cos_sin_cache, kv, loc, out)


@_cpu_rope_store_into_op.register_fake
def _(qkv, heads_q, heads_kv, head_dim, positions, cos_sin_cache, kv, loc, out):
    return None


out_twins.register(torch.ops.capture_service_test.rope_store_qkv,
                   torch.ops.capture_service_test.rope_store_qkv_into.default)  # fmt: skip


def _cpu_kernel_module():
    import types

    return types.SimpleNamespace(
        fits=lambda qkv, heads, d, kv: tuple(kv.shape[1:]) == (2, heads[1], d),
        rope_store=_cpu_rope_store,
        rope_store_qkv_op=_cpu_rope_store_op,
    )


def _cpu_flashinfer_kernels():
    """FlashInferKernels' routing (the kernel eagerly, the op when compiled, the contexts) with
    the torch reference where FlashInfer's own kernels would run."""
    from service.model.kernels import FlashInferKernels

    class CpuFlashInfer(FlashInferKernels):
        def __init__(self) -> None:
            self.fi = None
            self._rope_store = _cpu_kernel_module()

        rms_norm = Kernels.rms_norm
        _add_rms_norm = Kernels._add_rms_norm
        silu_and_mul = Kernels.silu_and_mul

        def rope(self, ctx, q, k, head_dim):
            if not torch.compiler.is_compiling():  # FlashInfer's context: positions, table
                ctx = Kernels.rope_context(self, *ctx)
            return super().rope(ctx, q, k, head_dim)

    return CpuFlashInfer()


@pytest.mark.parametrize("backend", ["tc_piecewise", "full"])
def test_the_kernel_routes_keep_the_results_and_store_once(backend, monkeypatch):
    """On CPU, the kernel's stand-in (the torch reference behind the kernel's contract) under
    FlashInferKernels' routing: eager calls make the kernel call, tc_piecewise's compiled pieces
    make the op's twin, writing into the very buffer the layer's attention reads (a piece that
    wrote elsewhere and copied, or whose attention read another buffer, fails), and then no
    store op of their own (a piece that stored twice or not at all, or whose attention read an
    unrotated K, fails), and the logits and the cache match the plain route's (float32: the
    same arithmetic, in another order)."""
    import service.ranks.attention.custom_op as custom_op
    import service.ranks.startup as startup

    stores: list[int] = []
    real_store = custom_op._store
    monkeypatch.setattr(custom_op, "_store", lambda k, v, kv, loc: stores.append(k.shape[0])
                        or real_store(k, v, kv, loc))  # fmt: skip
    plain = small_engine(backend, "cpu")
    monkeypatch.setattr(startup, "make_kernels", lambda *a, **k: _cpu_flashinfer_kernels())
    routed = small_engine(backend, "cpu")
    assert routed.executor.worker.model.kernels.stores_kv()
    outs = []
    for e in (plain, routed):
        w = e.executor.worker
        batch = live_batch(w, (20, 17, 11), seed=3)
        hit = decide_replay(e.resolved.plan, 48, 3)
        _op_calls.clear()
        _into_calls.clear()
        stores.clear()
        with torch.inference_mode():
            for t in w.kv.kv:
                t.zero_()
            got = w.runner.run(batch, hit).clone()
            outs.append((got, torch.stack([t.clone() for t in w.kv.kv])))
        counts = (len(_op_calls), len(stores))
        into = list(_into_calls)
    (p_out, p_cache), (r_out, r_cache) = outs
    op_calls, routed_stores = counts  # the routed run's
    assert (p_out - r_out).abs().max().item() < 1e-4 * p_out.abs().max().item()
    assert (p_cache - r_cache).abs().max().item() < 1e-4 * p_cache.abs().max().item()
    assert (r_cache[:, 1:].abs().amax(dim=(1, 2, 3, 4)) > 0).all()  # every layer stored
    layers = len(routed.executor.worker.model.layers)
    if backend == "tc_piecewise":  # every layer through the twin, and no store op at all
        assert (op_calls, len(into), routed_stores) == (0, layers, 0)
        tape = routed.executor.worker.runner._captured[hit.bucket]
        assert into == [c.q.data_ptr() for c in tape.calls.calls]
    else:  # full's graphs are not compiled: the kernel's eager call, never the op
        assert op_calls == 0 and into == []


# ---- CUDA ---------------------------------------------------------------------------------------
def _needs_triton() -> None:
    pytest.importorskip("triton", reason="needs triton")


def _reference(qkv, heads, d, positions, table, kv, loc):
    """The torch reference on copies: rotate q and k ("rotate half", float32), store K and V."""
    from service.model.kernels import _rotate
    from service.ranks.kv_pool import store_entries

    hq, hkv = heads
    t = qkv.shape[0]
    qkv, kv = qkv.clone(), kv.clone()
    cos, sin = table.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    qk = qkv[:, : (hq + hkv) * d].reshape(t, hq + hkv, d)
    qkv[:, : (hq + hkv) * d] = _rotate(qk, cos, sin).reshape(t, -1)
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    v = qkv[:, (hq + hkv) * d : (hq + 2 * hkv) * d].reshape(t, hkv, d)
    store_entries(kv, loc, k, v)
    return qkv, kv


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 37, 1023, 2048, 2051])
@pytest.mark.parametrize("heads,d", [((12, 2), 128), ((4, 4), 64)])
def test_the_kernel_matches_the_torch_reference(tokens, heads, d):
    """Rows wider than q, k and v (a padded qkv buffer), positions out of order, slots shuffled
    with padded tokens on the padding slot: q and k within one bf16 rounding of the reference,
    v and the columns past v untouched, and the cache holding exactly what the kernel left in k
    and v (a kernel that swapped halves, mixed heads, stored unrotated K or wrote the wrong slot
    fails)."""
    _needs_triton()
    from service.model import rope_store_triton as rs

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(tokens + d)
    hq, hkv = heads
    width = (hq + 2 * hkv) * d
    buf = torch.randn(tokens, width + 64, generator=g, device=dev).to(torch.bfloat16)
    qkv = buf[:, :width]
    positions = torch.randperm(4096, generator=g, device=dev)[:tokens]
    table = torch.randn(4096, d, generator=g, device=dev)  # any float32 table
    slots = tokens + 10
    loc = torch.randperm(slots, generator=g, device=dev)[:tokens] + 1
    loc[tokens // 2 :: 7] = 0  # padded tokens: the padding slot, written by any of them
    kv = torch.zeros(slots + 1, 2, hkv, d, dtype=torch.bfloat16, device=dev)
    want_qkv, want_kv = _reference(qkv, heads, d, positions, table, kv, loc)
    before = buf.clone()
    assert rs.fits(qkv, heads, d, kv)
    rs.rope_store(qkv, heads, d, positions, table, kv, loc)
    torch.cuda.synchronize()
    rot = (hq + hkv) * d
    scale = want_qkv[:, :rot].float().abs().max()
    assert ((qkv[:, :rot].float() - want_qkv[:, :rot].float()).abs().max() / scale) < 8e-3
    assert torch.equal(qkv[:, rot:], before[:, rot:width])  # v as it was
    assert torch.equal(buf[:, width:], before[:, width:])  # past the row's qkv: untouched
    live = loc != 0
    k = qkv[:, hq * d : rot].reshape(tokens, hkv, d)
    v = qkv[:, rot:width].reshape(tokens, hkv, d)
    assert torch.equal(kv[loc[live], 0], k[live]) and torch.equal(kv[loc[live], 1], v[live])
    untouched = torch.ones(slots + 1, dtype=torch.bool, device=dev)
    untouched[loc] = False
    assert kv[untouched].abs().sum().item() == 0  # no slot outside loc was written
    assert torch.equal(want_kv[untouched], kv[untouched])
    # out of place (the op compiled pieces call): the same bits in a new tensor, qkv as it was
    kv2 = torch.zeros_like(kv)
    fresh = before[:, :width].clone()
    got = rs.rope_store_qkv_op(fresh, hq, hkv, d, positions, table, kv2, loc)
    assert torch.equal(fresh, before[:, :width])
    assert got.shape == (tokens, width) and torch.equal(got, qkv)
    assert torch.equal(kv2[loc[live]], kv[loc[live]])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 37, 256, 2051])
def test_the_kernel_adds_the_projections_bias_before_rotating(tokens):
    """The kernel given qkv's bias (the projection ran without it): v and the cache's V are the
    biased projection rounded once, exactly; q and k within one bf16 rounding of the reference
    rotating the biased projection; the cache's K is the kernel's k (a kernel that dropped the
    bias, added it to one part only, added it after rotating or left v unbiased fails)."""
    _needs_triton()
    from service.model import rope_store_triton as rs

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(tokens)
    (hq, hkv), d = (12, 2), 128
    width = (hq + 2 * hkv) * d
    qkv = torch.randn(tokens, width, generator=g, device=dev).to(torch.bfloat16)
    bias = torch.randn(width, generator=g, device=dev).to(torch.bfloat16)
    positions = torch.randperm(4096, generator=g, device=dev)[:tokens]
    table = torch.randn(4096, d, generator=g, device=dev)
    loc = torch.arange(1, tokens + 1, device=dev)
    kv = torch.zeros(tokens + 1, 2, hkv, d, dtype=torch.bfloat16, device=dev)
    biased = (qkv.float() + bias.float()).to(torch.bfloat16)
    want_qkv, _ = _reference(biased, (hq, hkv), d, positions, table, kv, loc)
    rs.rope_store(qkv, (hq, hkv), d, positions, table, kv, loc, bias=bias)
    torch.cuda.synchronize()
    rot = (hq + hkv) * d
    scale = want_qkv[:, :rot].float().abs().max()
    assert ((qkv[:, :rot].float() - want_qkv[:, :rot].float()).abs().max() / scale) < 8e-3
    assert torch.equal(qkv[:, rot:], biased[:, rot:])
    k = qkv[:, hq * d : rot].reshape(tokens, hkv, d)
    v = qkv[:, rot:].reshape(tokens, hkv, d)
    assert torch.equal(kv[loc, 0], k) and torch.equal(kv[loc, 1], v)


def _op_inputs(tokens: int, dev: torch.device):
    """qkv of 4 q and 2 K/V heads of 128, positions, slots 1..tokens and two empty caches."""
    qkv = torch.randn(tokens, 8 * 128, device=dev).to(torch.bfloat16)
    positions = torch.arange(tokens, device=dev)
    loc = torch.arange(1, tokens + 1, device=dev)
    kv_a = torch.zeros(tokens + 1, 2, 2, 128, dtype=torch.bfloat16, device=dev)
    return qkv, positions, loc, kv_a, torch.zeros_like(kv_a)


@pytest.mark.gpu
def test_the_op_in_a_compiled_function_gives_the_kernels_bits():
    """tc_piecewise's pieces call the op with symbolic token counts: a compiled function over it
    returns what a direct call returns and writes the same cache, at several sizes."""
    _needs_triton()
    from service.model import rope_store_triton as rs

    dev = torch.device("cuda")
    table = torch.randn(512, 128, device=dev)
    torch._dynamo.reset()

    def piece(qkv, positions, kv, loc):
        return rs.rope_store_qkv_op(qkv, 4, 2, 128, positions, table, kv, loc) * 2

    fn = torch.compile(piece, dynamic=True, fullgraph=True)
    for tokens in (16, 300, 64):
        qkv, positions, loc, kv_a, kv_b = _op_inputs(tokens, dev)
        got = fn(qkv, positions, kv_a, loc)
        want = piece(qkv, positions, kv_b, loc)
        assert torch.equal(got, want) and torch.equal(kv_a, kv_b) and kv_a.abs().sum() > 0


@pytest.mark.gpu
def test_the_twin_writes_the_ops_bits_into_the_buffer_it_is_given():
    """The op's twin (what tc_piecewise's pieces call on their hand-over buffer), compiled as a
    piece is: the op's bits and cache, written into the given rows of a larger buffer and
    nowhere else, with no copy kernel in the generated code; a buffer of the wrong shape is
    refused with what it should be."""
    _needs_triton()
    from torch._inductor.utils import run_and_get_code

    from service.model import rope_store_triton as rs

    dev = torch.device("cuda")
    table = torch.randn(512, 128, device=dev)
    torch._dynamo.reset()

    def piece(out, qkv, positions, kv, loc):
        rs.rope_store_qkv_into_op(qkv, 4, 2, 128, positions, table, kv, loc, out)
        return out

    fn = torch.compile(piece, dynamic=True, fullgraph=True)
    big = torch.full((400, 8 * 128), float("nan"), device=dev, dtype=torch.bfloat16)
    for tokens in (16, 300, 64):
        qkv, positions, loc, kv_a, kv_b = _op_inputs(tokens, dev)
        big.fill_(float("nan"))
        got, code = run_and_get_code(fn, big[:tokens], qkv, positions, kv_a, loc)
        want = rs.rope_store_qkv_op(qkv, 4, 2, 128, positions, table, kv_b, loc)
        assert got.data_ptr() == big.data_ptr() and torch.equal(big[:tokens], want)
        assert big[tokens:].isnan().all() and torch.equal(kv_a, kv_b) and kv_a.abs().sum() > 0
        assert "copy" not in "\n".join(code).lower()
    with pytest.raises(ValueError, match=r"row-major \(16, 1024\)"):
        rs.rope_store_qkv_into_op(qkv[:16], 4, 2, 128, positions[:16], table, kv_a, loc[:16],
                                  big[:16, :512])  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["breakable", "full", "tc_piecewise", "eager"])
def test_the_model_with_the_kernel_matches_the_model_without_it(backend, monkeypatch, tmp_path):
    """The built-in model in bf16 with FlashInfer's fused kernels, with and without the rotary +
    store kernel: logits within 2e-2 of their scale (one rounding of q and k apart), and the
    kernel really ran, in the captured graphs and in eager calls (tc_piecewise: through the op
    in its compiled pieces, which then emit no store of their own), and every layer's K/V in
    the cache after the run as eager stores them (the ragged attention reads K/V from the
    projection, so only the cache shows a run that stored nothing)."""
    _needs_triton()
    pytest.importorskip("flashinfer", reason="the kernel runs with FlashInfer's fused kernels")
    import service.model.kernels as kernels_module
    from service.model import rope_store_triton as rs
    from tests.fi_model import write_fi_model

    # Qwen2's qkv bias, handed to the kernel in eager calls and the captured graphs at every
    # size (whatever rope_store_policy.bias_in_rope says today)
    monkeypatch.setattr(kernels_module, "bias_in_rope", lambda tokens: True)
    biased = write_fi_model(tmp_path / "model", attention_bias=True)
    model = {"model_path": str(biased), "load_format": "random"}
    rows: list[int] = []
    with_bias: list[bool] = []
    real = rs.rope_store

    def spy(qkv, *a, **kw):
        rows.append(qkv.shape[0])
        with_bias.append(kw.get("bias") is not None)
        return real(qkv, *a, **kw)

    monkeypatch.setattr(rs, "rope_store", spy)
    on = small_engine(
        backend, "cuda", fused_kernels="flashinfer", rope_store_kernel="triton", **model
    )
    off = small_engine(
        backend, "cuda", fused_kernels="flashinfer", rope_store_kernel="torch", **model
    )
    assert on.resolved.limits.rope_store.name == "triton"
    assert off.resolved.limits.rope_store.name == "torch"
    if backend != "eager":
        assert 64 in rows  # captured: the 64-token bucket's graphs launch the kernel
    outs = []
    for e in (on, off):
        w = e.executor.worker
        batch = live_batch(w, (20, 17, 11), seed=3)
        hit = decide_replay(e.resolved.plan, 48, 3)
        runner = w.eager_runner if backend == "eager" else w.runner
        with torch.inference_mode():
            eager = w.eager_runner.run(batch, hit).float()
            eager_cache = torch.stack([t.float() for t in w.kv.kv])
            for t in w.kv.kv:  # what the run stores, not what eager left there
                t.zero_()
            run = runner.run(batch, hit).float()
            run_cache = torch.stack([t.float() for t in w.kv.kv])
        outs.append((eager, run, eager_cache, run_cache))
    (on_eager, on_run, on_ecache, on_rcache), (off_eager, off_run, off_ecache, _) = outs
    assert 48 in rows  # eager calls take it too
    assert any(with_bias)  # the projection's bias handed to the kernel
    scale = off_eager.abs().max().item()
    assert (on_eager - off_eager).abs().max().item() < 2e-2 * scale
    assert (on_run - off_run).abs().max().item() < 2e-2 * scale
    assert (on_run - on_eager).abs().max().item() < 2e-2 * scale
    # every layer's K/V stored by the run, as eager stores them (the padding slot aside)
    kv_scale = off_ecache.abs().max().item()
    assert kv_scale > 0 and (on_rcache[:, 1:].abs().amax(dim=(1, 2, 3, 4)) > 0).all()
    assert (on_rcache[:, 1:] - on_ecache[:, 1:]).abs().max().item() < 2e-2 * kv_scale
    assert (on_ecache[:, 1:] - off_ecache[:, 1:]).abs().max().item() < 2e-2 * kv_scale
