"""DeepSeek V2/V3 (MLA + MoE) against Hugging Face transformers' own implementations, and
through every prefill graph backend and the decode graphs on CPU. Batched prefill, greedy
generation and the loader's errors against transformers run with the other families in
tests/test_model_vs_transformers.py.

Tiny random checkpoints written by transformers (tests.hf_models): V2's structure (plain q
projection, softmax greedy routing) and V3's (q LoRA, sigmoid grouped routing with a correction
bias, normalised and scaled weights), both with YaRN and one dense layer before the experts.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from service.config import DecodeGraphConfig, EngineConfig, GraphConfig
from service.engine import Engine
from service.model.attention import MLA_LATENT, MLA_NEW, AttentionKey
from service.ranks.attention.base import AttentionBackend
from service.sampling import SamplingParams
from tests.hf_models import hf_logits, make_deepseek_v2, make_deepseek_v3

TOL = 1e-4
PROMPTS = [[5, 17, 99, 3, 250, 8, 8, 1], [42] * 3, list(range(10, 60)), [7]]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["v2", "v3"])
def checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"deepseek_{request.param}")
    model = (make_deepseek_v2 if request.param == "v2" else make_deepseek_v3)(out)
    return out, model


def engine_for(path, backend: str = "eager", decode_graphs: bool = False, **kw) -> Engine:
    chunked = kw.pop("chunked_prefill_size", None)
    cfg = EngineConfig(
        model_path=str(path),
        dtype="float32",
        device="cpu",
        context_length=kw.pop("context_length", 128),
        max_running_requests=kw.pop("max_running_requests", 4),
        kv_cache_memory_bytes=8 << 20,
        graph=GraphConfig(backend=backend, buckets=kw.pop("buckets", None), **kw),
        decode=DecodeGraphConfig(enabled=decode_graphs),
        chunked_prefill_size=chunked,
    )
    engine = Engine(cfg)
    engine.return_logits = True
    return engine


def test_the_cache_holds_one_latent_entry_per_token(checkpoint):
    path, _ = checkpoint
    worker = engine_for(path).executor.worker
    kv = worker.kv
    # kv_lora_rank 32 + qk_rope_head_dim 8, once per token and layer: no per-head keys/values
    assert kv.layout.parts == 1 and kv.k[0].shape[1:] == (1, 40)
    assert kv.v[0].data_ptr() == kv.k[0].data_ptr()
    reg = worker.model.registry
    mha, mqa = reg.spec(AttentionKey(1, "mha")), reg.spec(AttentionKey(1, "mqa"))
    assert (mha.kind, mha.num_kv_heads, mha.head_dim) == (MLA_NEW, 4, 24)
    assert (mqa.kind, mqa.num_kv_heads, mqa.head_dim) == (MLA_LATENT, 1, 40)
    assert worker.info.attention.name == "torch"


@pytest.mark.parametrize("decode_graphs", [False, True])
def test_chunked_prefill_on_a_cached_prefix_and_decode_match(checkpoint, decode_graphs):
    path, hf = checkpoint
    engine = engine_for(path, chunked_prefill_size=16, decode_graphs=decode_graphs)
    prompt = PROMPTS[2]  # 50 tokens: chunks of 16, 16, 16, 2 over a growing cached prefix
    (out,) = engine.generate([prompt], GREEDY)
    prefills = [b for b, _ in engine.last_logits if b.command.is_prefill]
    assert [b.command.prefix_lens[0] for b in prefills] == [0, 16, 32, 48]
    full = prompt + out.output_ids
    ref = hf_logits(hf, full)
    pos = len(prompt) - 1
    for batch, result in engine.last_logits:
        if batch.command.is_prefill and batch.command.prefix_lens[0] + 16 < len(prompt):
            continue
        assert (result.logits[0] - ref[pos]).abs().max().item() < TOL, pos
        pos += 1
    assert pos == len(full) - 1
    expected = {"graph": 5, "eager": 0} if decode_graphs else {"graph": 0, "eager": 5}
    assert out.meta_info["decode_steps"] == expected


def mixed_run(engine: Engine, calls: list | None = None):
    """Two requests whose second prefill batch mixes a continued request (cached prefix: the
    MQA path) with a fresh one (the MHA path)."""
    engine.last_logits.clear()
    outs = engine.generate([list(range(3, 53)), [9, 4, 1, 7, 7, 2, 30, 11, 5, 6]], GREEDY)
    prefills = [(b, r) for b, r in engine.last_logits if b.command.is_prefill]
    return outs, prefills


@pytest.mark.parametrize("backend", ["full", "breakable", "tc_piecewise"])
def test_graph_replay_of_batches_using_both_paths_equals_eager(checkpoint, backend, caplog):
    path, _ = checkpoint
    kw = dict(chunked_prefill_size=32, buckets=(16, 32, 64))
    eager = engine_for(path, **kw)
    with caplog.at_level(logging.WARNING):
        graph = engine_for(path, backend, **kw)
    # `full` works for MLA but is slow on GPU: the operator is told what to use instead
    warned = "use --prefill-backend breakable" in caplog.text
    assert warned is (backend == "full")
    g_outs, g_prefills = mixed_run(graph)
    e_outs, e_prefills = mixed_run(eager)
    mixed = [b for b, _ in g_prefills if sorted(b.command.prefix_lens) == [0, 32]]
    assert mixed, [b.command.prefix_lens for b, _ in g_prefills]
    runner = graph.executor.worker.runner
    replays = sum(c.replays for b in runner.captured_buckets() for c in runner.captured_calls(b))
    assert replays >= len(g_prefills)  # every prefill went through the captured calls
    for (gb, g), (_, e) in zip(g_prefills, e_prefills, strict=True):
        assert g.record.graph_hit, g.record
        diff = (g.logits - e.logits).abs().max().item()
        # float32 rounding apart, not more: `full` runs the graph-safe slot attention; every
        # backend routes the bucket's padded tokens to experts too, so an expert's GEMM sees
        # more rows than in eager, and CPU BLAS may block (and so round) by row count (seen on
        # an AMD EPYC host: 6e-7 to 8e-7; bit-equal on others)
        assert diff < 1e-5, (gb.command.prefix_lens, diff)
    assert [o.output_ids for o in g_outs] == [o.output_ids for o in e_outs]


def test_each_path_gets_its_own_metadata_in_one_forward(checkpoint, monkeypatch):
    """DESIGN invariant 8: the MHA path (192-wide heads for V2-Lite) must never be handed the
    MQA path's metadata (576-wide, one KV head), though both share a layer id."""
    path, _ = checkpoint
    seen: list[tuple[str, str, int]] = []
    heads = AttentionBackend.heads

    def spy(self, q, key):
        spec, q3 = heads(self, q, key)
        seen.append((key.variant, spec.kind, q3.shape[-1]))
        return spec, q3

    monkeypatch.setattr(AttentionBackend, "heads", spy)
    mixed_run(engine_for(path, chunked_prefill_size=32))
    assert {s for s in seen if s[0] == "mha"} == {("mha", MLA_NEW, 24)}
    assert {s for s in seen if s[0] == "mqa"} == {("mqa", MLA_LATENT, 40)}
    # and a path handed the other's metadata fails loudly instead of attending wrongly
    backend = engine_for(path).executor.worker.setup.eager_attention
    with pytest.raises(ValueError, match="does not match its path's metadata"):
        heads(backend, torch.zeros(3, 4 * 24), AttentionKey(1, "mqa"))


def test_grouped_gemm_fallback_equals_the_native_kernel(monkeypatch):
    """The fallback (CUDA fp16/fp32, where torch._grouped_mm does not run) against the native
    kernel, with empty groups and a group holding every row."""
    from service.model import grouped_gemm

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(12, 8, generator=gen)
    b = torch.randn(4, 8, 16, generator=gen).transpose(1, 2).contiguous().transpose(1, 2)
    for offs in ([3, 3, 10, 12], [0, 12, 12, 12], [1, 2, 3, 12]):
        o = torch.tensor(offs, dtype=torch.int32)
        native = grouped_gemm.grouped_mm(a, b, o)
        monkeypatch.setattr(grouped_gemm, "native", lambda a: False)
        fallback = grouped_gemm.grouped_mm(a, b, o)
        monkeypatch.undo()
        starts = [0, *offs[:-1]]
        ref = torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, offs, strict=True))])
        assert torch.allclose(native, ref, atol=1e-5) and torch.allclose(fallback, ref, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["full", "breakable", "tc_piecewise"])
def test_graphs_on_cuda_in_bfloat16_match_eager(tmp_path_factory, backend):
    """On CUDA in bf16: the native grouped GEMM, the torch MLA paths inside CUDA graphs
    (prefill backends and decode graphs) against the same model run eagerly."""
    if not torch.cuda.is_available():
        pytest.skip("gpu: needs a CUDA device; none on this machine")
    path = tmp_path_factory.mktemp("deepseek_cuda")
    make_deepseek_v3(path)

    def make(b: str) -> Engine:
        cfg = EngineConfig(
            model_path=str(path),
            dtype="bfloat16",
            device="cuda",
            context_length=128,
            max_running_requests=4,
            kv_cache_memory_bytes=64 << 20,
            chunked_prefill_size=32,
            graph=GraphConfig(backend=b, buckets=(16, 32, 64)),
            decode=DecodeGraphConfig(enabled=b != "eager"),
        )
        e = Engine(cfg)
        e.return_logits = True
        return e

    graph, eager = make(backend), make("eager")
    g_outs, g_prefills = mixed_run(graph)
    _, e_prefills = mixed_run(eager)
    assert graph.resolved.graph_kind == "cuda" and graph.resolved.decode_graph_kind == "cuda"
    assert any(sorted(b.command.prefix_lens) == [0, 32] for b, _ in g_prefills)
    for (_, g), (_, e) in zip(g_prefills, e_prefills, strict=True):
        assert g.record.graph_hit and g.record.graph_kind == "cuda"
        rel = (g.logits - e.logits).abs().max() / e.logits.abs().max()
        assert rel.item() < 3e-2  # bf16 rounding and shape-dependent kernel choice
    assert all(o.meta_info["decode_steps"]["graph"] == 5 for o in g_outs)
    # greedy tokens: equal until the first step where they differ, and there only by a near-tie
    # of the eager logits (bf16 kernels fused differently may flip one; the histories differ
    # after it)
    for prompt in ([9, 4, 1, 7, 7, 2, 30, 11, 5, 6], list(range(3, 40))):
        steps = []
        for e in (graph, eager):
            e.last_logits.clear()
            (out,) = e.generate([prompt], GREEDY)
            steps.append((out.output_ids, [r.logits[0] for _, r in e.last_logits]))
        (g_ids, _), (e_ids, e_logits) = steps
        for j, (a, b) in enumerate(zip(g_ids, e_ids, strict=True)):
            if a != b:
                row = e_logits[j]
                assert row[a] >= row.max() - 3e-2 * row.abs().max(), (j, a, b)
                break


def test_a_quantized_checkpoint_is_refused_with_what_to_do(tmp_path, checkpoint):
    """V3's published weights are fp8 blocks with scales: loading them as plain tensors would
    serve garbage, so the loader refuses them and names the way out."""
    import json
    import shutil

    from service.errors import CheckpointError

    path, _ = checkpoint
    quantized = tmp_path / "fp8"
    shutil.copytree(path, quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="fp8-quantized weights are not supported; convert"):
        engine_for(quantized)


@pytest.mark.gpu
def test_flashinfer_mla_decode_graphs_match_torch_decode(tmp_path):
    """FlashInfer's MLA paged wrapper inside decode graphs (V2-Lite's MLA widths: latent 512,
    rotary 64, 16 heads) against the torch decode attention, same random weights."""
    if not torch.cuda.is_available():
        pytest.skip("gpu: needs a CUDA device; none on this machine")
    import json

    from benchmarks.prefill_graphs import DEEPSEEK_V2_LITE

    cfg = dict(DEEPSEEK_V2_LITE, vocab_size=1024, hidden_size=256, intermediate_size=512,
               moe_intermediate_size=128, num_hidden_layers=3, n_routed_experts=8)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    def make(attention: str) -> Engine:
        e = Engine(
            EngineConfig(
                model_path=str(tmp_path),
                load_format="random",
                dtype="bfloat16",
                device="cuda",
                context_length=256,
                max_running_requests=4,
                kv_cache_memory_bytes=64 << 20,
                graph=GraphConfig(backend="breakable", buckets=(64, 128)),
                decode=DecodeGraphConfig(enabled=attention == "auto"),
                attention_backend=attention,
            )
        )
        e.return_logits = True
        return e

    fi, ref = make("auto"), make("torch")
    assert fi.resolved.limits.attention.name == "flashinfer"
    decode = fi.executor.worker.setup.decode_attention
    assert decode.name == "flashinfer_mla_decode"
    prompts = [list(range(5, 60)), [3, 1, 4, 1, 5, 9, 2, 6], list(range(100, 200))]
    steps = {}
    for name, e in (("fi", fi), ("ref", ref)):
        e.last_logits.clear()
        outs = e.generate(prompts, GREEDY)
        decodes = [r.logits for b, r in e.last_logits if not b.command.is_prefill]
        steps[name] = ([o.output_ids for o in outs], decodes, outs)
    assert all(o.meta_info["decode_steps"] == {"graph": 5, "eager": 0} for o in steps["fi"][2])
    (fi_ids, fi_logits, _), (ref_ids, ref_logits, _) = steps["fi"], steps["ref"]
    if fi_ids == ref_ids:  # same histories: every decode step's logits comparable
        for a, b in zip(fi_logits, ref_logits, strict=True):
            assert ((a - b).abs().max() / b.abs().max()).item() < 3e-2
    else:  # a bf16 near-tie flipped a token: the first step's logits are still comparable
        a, b = fi_logits[0], ref_logits[0]
        assert ((a - b).abs().max() / b.abs().max()).item() < 3e-2


def _our_router(hf_router, cfg: dict):
    from service.model.arch_config import parse_moe
    from service.model.moe import Router

    moe = parse_moe(cfg, "test", v3=cfg["architectures"] == ["DeepseekV3ForCausalLM"])
    ours = Router(moe, cfg["hidden_size"])
    with torch.no_grad():
        ours.weight.copy_(hf_router.weight)
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)
    return ours


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_router_chooses_and_weighs_experts_as_transformers_does(method):
    """Each routing method against transformers' router of that family: the same experts per
    token, with the same weights (V2's group-limited greedy is not in the tiny checkpoints)."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(4)
    common = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                  topk_group=2, routed_scaling_factor=2.5)  # fmt: skip
    if method == "noaux_tc":
        cfg = dict(common, norm_topk_prob=True, architectures=["DeepseekV3ForCausalLM"])
        hf = DeepseekV3TopkRouter(DeepseekV3Config(**common, norm_topk_prob=True))
        torch.nn.init.normal_(hf.e_score_correction_bias, std=0.1)
    else:
        cfg = dict(common, topk_method=method, architectures=["DeepseekV2ForCausalLM"])
        hf = DeepseekV2TopkRouter(DeepseekV2Config(**common, topk_method=method))
    torch.nn.init.normal_(hf.weight, std=0.5)
    cfg.update(moe_intermediate_size=8)
    ours = _our_router(hf, cfg)
    x = torch.randn(64, 32)
    with torch.no_grad():
        _, ref_w, ref_ids = hf(x)
        w, ids = ours(x)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order))


@given(
    tokens=st.integers(1, 40),
    experts=st.integers(1, 6),
    top_k=st.integers(1, 3),
    skew=st.booleans(),
    seed=st.integers(0, 1 << 16),
)
@settings(max_examples=25, deadline=None)
def test_routed_experts_equal_a_loop_over_tokens(tokens, experts, top_k, skew, seed):
    """The grouped-GEMM dispatch (sort by expert, two grouped GEMMs, deterministic combine)
    against the definition: for each token, the weighted sum of its chosen experts' SwiGLU.
    ``skew`` sends every choice to expert 0 (one group holds all rows, the others none)."""
    from service.model.arch_config import MoeConfig
    from service.model.kernels import Kernels
    from service.model.moe import RoutedExperts
    from service.model.parallel import TPGroup

    top_k = min(top_k, experts)
    gen = torch.Generator().manual_seed(seed)
    cfg = MoeConfig(experts, top_k, 8, 0, 0, "softmax", "greedy", 1, 1, False, 1.0)
    moe = RoutedExperts(cfg, 12, TPGroup(), Kernels())
    with torch.no_grad():
        moe.w13.copy_(torch.randn(moe.w13.shape, generator=gen))
        moe.w2.copy_(torch.randn(moe.w2.shape, generator=gen))
    x = torch.randn(tokens, 12, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    if skew:
        ids = torch.zeros_like(ids)
    weights = torch.rand(tokens, top_k, generator=gen)
    out = moe(x, weights, ids)
    ref = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            gate, up = (moe.w13[e] @ x[t]).chunk(2)
            ref[t] += weights[t, j] * (moe.w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
