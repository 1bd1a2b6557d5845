"""FlashInfer attention on a GPU: each eager path against the torch reference, and every graph
runner (``full`` through FlashInfer's CUDA-graph mode) against eager, in bf16.

Skipped without CUDA (the `gpu` marker) or without FlashInfer installed (the `gpu` extra).
"""

from __future__ import annotations

import random

import pytest
import torch

from service.config import EngineConfig, GraphConfig
from service.engine import Engine
from service.model.attention import AttendCall
from service.ranks.attention.base import AttendCalls
from service.ranks.attention.torch_varlen import TorchVarlenAttention
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.ranks.select import flashinfer_import_error
from service.ranks.startup import set_up_rank
from service.sampling import SamplingParams
from tests.fi_model import write_fi_model

CTX = 512


def _needs_flashinfer():
    if not torch.cuda.is_available():
        return pytest.mark.skip(reason="gpu: needs a CUDA device; none on this machine")
    err = flashinfer_import_error()
    return pytest.mark.skipif(err is not None, reason=f"needs FlashInfer (the gpu extra): {err}")


pytestmark = [pytest.mark.gpu, _needs_flashinfer()]

# bf16 inputs; FlashInfer and SDPA accumulate in fp32 but tile and split differently
REL_TOL = 2e-2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_fi_model(tmp_path_factory.mktemp("fi-model"))


def cfg(model_dir, backend: str = "eager", **graph) -> EngineConfig:
    return EngineConfig(
        model_path=str(model_dir),
        load_format="random",
        dtype="bfloat16",
        device="cuda",
        context_length=CTX,
        max_running_requests=8,
        chunked_prefill_size=1024,
        kv_cache_memory_bytes=256 << 20,
        attention_backend="flashinfer",
        graph=GraphConfig(backend=backend, **graph),
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max()).item()


CASES = [
    ("ragged", ForwardMode.EXTEND, (0, 0, 0), (100, 37, 260)),
    ("paged", ForwardMode.EXTEND, (50, 0, 200), (30, 64, 5)),
    ("decode", ForwardMode.DECODE, (99, 10, 300), (1, 1, 1)),
]


@pytest.mark.parametrize(("path", "mode", "prefix", "extend"), CASES, ids=[c[0] for c in CASES])
def test_eager_paths_match_torch(model_dir, path, mode, prefix, extend, monkeypatch):
    worker = set_up_rank(cfg(model_dir))
    assert worker.info.attention.name == "flashinfer"
    fi = worker.eager_attention
    ref = TorchVarlenAttention(worker.model.registry, worker.kv, worker.req_to_token)
    key = worker.model.layers[1].self_attn.key
    spec = worker.model.registry.spec(key)
    rows = (3, 0, 5)  # not in order: the layout must follow the rows it is given
    layout = BatchLayout(mode, rows, prefix, extend)
    assert fi.path(layout) == path
    gen = torch.Generator(device="cuda").manual_seed(7)
    new_slots: list[int] = []
    for i, (row, p, e) in enumerate(zip(rows, prefix, extend, strict=True)):
        slots = list(range(1 + i * CTX, 1 + i * CTX + p + e))
        worker.req_to_token.write(row, 0, slots)
        new_slots += slots[p:]
        if p:  # a cached prefix: random K/V already in the pool
            idx = torch.tensor(slots[:p], device="cuda")
            shape = (p, spec.num_kv_heads, spec.head_dim)
            worker.kv.k[spec.kv_layer][idx] = torch.randn(shape, generator=gen, device="cuda").to(
                torch.bfloat16
            )
            worker.kv.v[spec.kv_layer][idx] = torch.randn(shape, generator=gen, device="cuda").to(
                torch.bfloat16
            )
    t = sum(extend)
    batch = ForwardBatch.build(layout, [1] * t, new_slots, torch.device("cuda"))

    def rand(width: int) -> torch.Tensor:
        return torch.randn(t, width, generator=gen, device="cuda").to(torch.bfloat16)

    q, k, v = (
        rand(spec.num_heads * spec.head_dim),
        rand(spec.num_kv_heads * spec.head_dim),
        rand(spec.num_kv_heads * spec.head_dim),
    )
    runs = []  # calls through FlashInfer's Python run, per wrapper
    for w in (*fi._ragged.values(), *fi._paged.values(), *fi._decode.values()):
        monkeypatch.setattr(w, "run", lambda *a, _run=w.run, **kw: runs.append(1) or _run(*a, **kw))
    with torch.inference_mode():
        bound = fi.bind(batch)
        bound.store(k, v, key)
        got = bound(q, k, v, key)
        want = ref.forward(q, k, v, key, batch)
        assert got.shape == want.shape == q.shape
        assert rel_err(got, want) < REL_TOL
        # a segment runner's layers: the same buffers with new contents and one output buffer.
        # The first call goes through FlashInfer's run and records its launch, the second
        # makes that launch directly: it must read the new contents and write the output
        out = torch.empty_like(q)
        for _ in range(2):
            for t_ in (q, k, v):
                t_.copy_(rand(t_.shape[1]))
            bound.store(k, v, key)
            got = bound(q, k, v, key, out)
            assert got.data_ptr() == out.data_ptr()
            assert rel_err(got, ref.forward(q, k, v, key, batch)) < REL_TOL
        assert len(runs) == 2, "the second call with the same views did not skip FlashInfer's run"
        if mode is ForwardMode.DECODE:
            return
        # a segment runner's tape: two layers' calls over the same tensors, resolved once per
        # forward without running anything, then made directly
        key0 = worker.model.layers[0].self_attn.key
        calls = AttendCalls((AttendCall(q, k, v, key, out), AttendCall(q, k, v, key0, out)))
        out.fill_(7.0)
        launches = bound.launchers(calls)
        torch.cuda.synchronize()
        assert bool(out.eq(7.0).all()), "resolving the launches ran a kernel"
        # ragged attention reads this pass's K/V only: both layers are one kernel call, made
        # below FlashInfer's Python (its compiled function); paged reads each layer's cache
        assert len(runs) == (3 if path == "ragged" else 4)
        if path == "ragged":
            assert launches[0] is launches[1]
            assert type(launches[0].func).__module__.startswith("tvm_ffi")
        for i, layer_key in enumerate((key, key0)):
            for t_ in (q, k, v):
                t_.copy_(rand(t_.shape[1]))
            bound.store(k, v, layer_key)
            launches[i]()
            assert rel_err(out, ref.forward(q, k, v, layer_key, batch)) < REL_TOL


def prefill_results(e: Engine, prompts: list[list[int]]):
    e.last_logits.clear()
    e.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
    return [(b, r) for b, r in e.last_logits if b.command.is_prefill]


@pytest.fixture(scope="module")
def eager_engine(model_dir):
    e = Engine(cfg(model_dir))
    e.return_logits = True
    return e


@pytest.mark.parametrize("backend", ["full", "breakable", "tc_piecewise"])
def test_graph_runners_match_eager(model_dir, eager_engine, backend):
    slots = 4 if backend == "full" else None
    g = Engine(cfg(model_dir, backend, buckets=(64, 256, 1024), full_request_slots=slots))
    g.return_logits = True
    assert g.resolved.limits.attention.name == "flashinfer"
    assert g.resolved.graph_kind == "cuda"
    if backend == "full":
        assert g.executor.worker.setup.graph_attention.name == "flashinfer_graph"
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    on_prefix_batches = 0  # prompts over the 1,024-token chunk continue on a cached prefix
    for _ in range(3):
        n = rng.randint(1, 4)
        prompts = [[rng.randrange(384) for _ in range(rng.randint(1, CTX - 8))] for _ in range(n)]
        got, want = prefill_results(g, prompts), prefill_results(eager_engine, prompts)
        assert len(got) == len(want)
        for (gb, gr), (eb, er) in zip(got, want, strict=True):
            assert gb.command.input_ids == eb.command.input_ids
            assert gr.record.graph_hit and gr.record.graph_kind == "cuda", (seed, gr.record)
            assert rel_err(gr.logits, er.logits) < REL_TOL, seed
            on_prefix_batches += any(gb.command.prefix_lens)
    runner = g.executor.worker.runner
    fresh = BatchLayout(ForwardMode.EXTEND, (0,), (0,), (1,))
    on_prefix = BatchLayout(ForwardMode.EXTEND, (0,), (1,), (1,))

    def replays(layout: BatchLayout) -> int:  # `full`: the chains of one attention variant
        chains = [runner.replayed_calls(b, layout) for b in runner.captured_buckets()]
        assert all(len({c.replays for c in chain}) == 1 for chain in chains)  # whole chains
        return sum(chain[0].replays for chain in chains)

    if backend == "full":  # fresh batches replay the ragged graphs, the rest the paged ones
        assert replays(fresh) > 0 and replays(on_prefix) == on_prefix_batches, seed
        # and the ragged graphs were planned through FlashInfer's module call alone
        replans = g.executor.worker.setup.graph_attention._replans.values()
        assert any(r.fast for r in replans)
    else:  # the segment backends plan fresh batches the same way, eager launches in between
        planned = runner.attention.planned
        assert planned is not None and any(r.fast for r in planned._replans.values())
    # 2,000 tokens over a 1,024-token chunk: the third prompt is split, and its second chunk
    # attends a cached prefix (the paged path; inside the graph for `full`)
    prompts = [[rng.randrange(384) for _ in range(500)] for _ in range(4)]
    got, want = prefill_results(g, prompts), prefill_results(eager_engine, prompts)
    assert [b.command.prefix_lens for b, _ in got] == [(0, 0, 0), (24, 0)]
    for (_, gr), (_, er) in zip(got, want, strict=True):
        assert gr.record.graph_hit
        assert rel_err(gr.logits, er.logits) < REL_TOL, seed
    if backend == "full":  # the chunk on a cached prefix replayed a paged graph
        assert replays(on_prefix) == on_prefix_batches + 1, seed


def test_decode_graphs_match_eager_decode(model_dir):
    """FlashInfer's decode wrapper in CUDA-graph mode (planned before each replay) against the
    eager decode wrapper, on a mix where the decode batch shrinks and grows. bf16 greedy tokens
    may part on a near-tie; steps are compared up to the first parting."""
    from dataclasses import replace

    from service.config import DecodeGraphConfig
    from tests.test_decode_graphs import run_mix

    base = cfg(model_dir, "breakable", buckets=(64, 256))
    on = Engine(replace(base, decode=DecodeGraphConfig(enabled=True, sizes=(1, 2, 4, 8))))
    off = Engine(replace(base, decode=DecodeGraphConfig(enabled=False)))
    assert on.resolved.decode_graph_kind == "cuda" and on.resolved.decode.sizes == (1, 2, 4, 8)
    on.return_logits = off.return_logits = True
    seed = random.randrange(1 << 30)
    run_mix(on, seed)
    run_mix(off, seed)
    got = [(b, r) for b, r in on.last_logits if not b.command.is_prefill]
    want = [(b, r) for b, r in off.last_logits if not b.command.is_prefill]
    assert {r.decode_record.graph_hit for _, r in got} == {True}
    compared = 0
    for (gb, gr), (eb, er) in zip(got, want, strict=False):
        if gb.command.input_ids != eb.command.input_ids:
            break  # a near-tie parted the two runs
        assert rel_err(gr.logits, er.logits) < REL_TOL, seed
        compared += 1
    assert compared >= 3, seed


def test_fast_ragged_replan_writes_what_flashinfer_plan_writes():
    """``full``'s replan of a CUDA-graph ragged wrapper (FlashInfer's module call alone, after
    the first plan) leaves the same indptrs, plan info and scheduled work in the buffers the
    graph reads as FlashInfer's own ``plan`` of the same layout does."""
    import flashinfer
    import numpy as np

    from service.ranks.attention.flashinfer_backend import GraphPlanBuffers
    from service.ranks.attention.flashinfer_replan import RaggedReplan
    from service.ranks.attention.paged_layout import indptr

    slots, dev = 4, torch.device("cuda")
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    bufs = GraphPlanBuffers.allocate(slots, CTX, dev)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, qo_indptr_buf=bufs.qo_indptr, kv_indptr_buf=bufs.kv_indptr
    )
    w.reset_workspace_buffer(ws, bufs.int_workspace)

    def plan(qo: torch.Tensor) -> None:
        w.plan(qo, qo, 12, 2, 128, causal=True, sm_scale=128**-0.5,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip

    replan = RaggedReplan(w, bufs.indptrs, plan)
    replan(np.array([CTX, CTX, 0, 0]))  # the capture layout: the bucket's rows
    rng = random.Random(0)
    for _ in range(6):
        k = rng.randint(1, slots)
        lens = [rng.randint(1, CTX // 2) for _ in range(k)] + [0] * (slots - k)
        replan(np.array(lens))
        assert replan.fast
        torch.cuda.synchronize()
        fast = (bufs.indptrs.clone(), bufs.int_workspace.clone(), list(w._plan_info))
        bufs.indptrs.zero_()
        bufs.int_workspace.zero_()
        plan(indptr(lens, pin=True))  # FlashInfer's own plan of the same layout
        torch.cuda.synchronize()
        assert torch.equal(fast[0], bufs.indptrs)
        assert fast[2] == list(w._plan_info)
        assert torch.equal(fast[1], bufs.int_workspace), lens


def test_the_service_finds_the_compiler_flashinfer_itself_would_run():
    """service.ranks.flashinfer_toolchain mirrors FlashInfer's own lookup without importing it;
    here, with FlashInfer installed, the two must name the same compiler (a later FlashInfer that
    looks elsewhere fails this, before `auto` misjudges a machine)."""
    import os

    from flashinfer.jit import cpp_ext

    from service.ranks import flashinfer_toolchain

    source = flashinfer_toolchain.find()
    theirs = os.environ.get("FLASHINFER_NVCC") or os.path.join(cpp_ext.get_cuda_path(), "bin/nvcc")
    assert source.looked_for == theirs
    # this machine built FlashInfer's kernels for the tests above (or loads them prebuilt)
    assert flashinfer_toolchain.blocker(source) is None, source
