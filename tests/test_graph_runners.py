"""Prefill graph runners on CPU: legal multi-request capture, replay == eager, sentinels, padding.

On CPU there is no CUDA graph object; every other part of capture and replay runs (synthetic
batches, static buffers, per-bucket compile for tc_piecewise, padding) and the graph kind is
reported as "cpu". The same tests run on CUDA (see tests/gpu), where the kind is "cuda".
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from service.buckets import MISS_TOO_MANY_REQUESTS, decide_replay
from service.config import EngineConfig, GraphConfig
from service.engine import Engine
from service.padding import PADDING_SLOT
from service.sampling import SamplingParams
from tests.batches import live_batch

BACKENDS = ["full", "breakable", "tc_piecewise"]
CTX = 128
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


def engine(backend: str, device: str = "cpu", **graph) -> Engine:
    cfg = EngineConfig(
        device=device,
        dtype="float32",
        context_length=graph.pop("context_length", CTX),
        max_running_requests=graph.pop("max_running_requests", 8),
        chunked_prefill_size=graph.pop("chunked_prefill_size", 512),
        kv_cache_memory_bytes=64 << 20,
        graph=GraphConfig(backend=backend, **graph),
    )
    e = Engine(cfg)
    e.return_logits = True
    return e


@pytest.fixture(scope="module")
def eager_engine(device):
    return engine("eager", device)


@pytest.fixture(scope="module", params=BACKENDS)
def graph_engine(request, device):
    slots = 6 if request.param == "full" else None
    return engine(request.param, device, full_request_slots=slots)


def kind(device: str) -> str:
    return "cuda" if device == "cuda" else "cpu"


def prefill_logits(e: Engine, prompts: list[list[int]]):
    e.last_logits.clear()
    outs = e.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
    (batch, result), *_ = e.last_logits
    assert batch.command.is_prefill
    return outs, result


def test_capture_covers_multi_request_buckets(graph_engine, device):
    plan = graph_engine.resolved.plan
    runner = graph_engine.executor.worker.runner
    assert runner.name == plan.backend
    assert runner.captured_buckets() == plan.bucket_sizes
    assert max(plan.bucket_sizes) == 512 > CTX  # buckets above one request's context
    big = plan.bucket(512)
    assert [n for n in big.capture_seq_lens if n] == [128, 128, 128, 128]
    assert graph_engine.resolved.graph_kind == kind(device)


def test_random_batches_replay_equals_eager(graph_engine, eager_engine, device):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    backend = graph_engine.resolved.plan.backend
    for _ in range(4):
        n = rng.randint(1, 6 if backend == "full" else 4)
        prompts = [[rng.randrange(384) for _ in range(rng.randint(1, CTX))] for _ in range(n)]
        g_out, g = prefill_logits(graph_engine, prompts)
        e_out, e = prefill_logits(eager_engine, prompts)
        assert g.record.graph_hit, (seed, g.record)
        assert g.record.bucket >= g.record.num_tokens  # batches over 512 tokens are chunked
        assert [o.output_ids for o in g_out] == [o.output_ids for o in e_out], seed
        diff = (g.logits - e.logits).abs().max().item()
        assert g.record.graph_kind == kind(device)
        if device == "cpu" and backend != "full" and g.record.num_tokens >= 16:
            # same kernels at the same shapes on CPU: bit-exact
            assert diff == 0.0, (seed, diff)
        else:
            # full uses the graph-safe slot attention, tiny batches a different GEMV path, and
            # cuBLAS picks kernels by shape: equal within float32 rounding
            assert diff < (1e-4 if device == "cuda" else 1e-5), (seed, diff)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_scenario(backend, device):
    prompts = [[(7 * i) % 384 for i in range(1301)], [(11 * i + 3) % 384 for i in range(1301)]]
    kw = dict(context_length=2048, max_running_requests=8, chunked_prefill_size=4096)
    slots = 4 if backend == "full" else None
    g = engine(backend, device, buckets=(4096,), full_request_slots=slots, **kw)
    plan = g.resolved.plan
    expected = (2048, 2048, 0, 0) if backend == "full" else (2048, 2048)
    assert plan.bucket(4096).capture_seq_lens == expected
    outs, res = prefill_logits(g, prompts)
    rec = res.record
    assert (rec.graph_hit, rec.bucket, rec.num_tokens, rec.padded_tokens) == (
        True,
        4096,
        2602,
        1494,
    )
    e = engine("eager", **kw)
    ref, _ = prefill_logits(e, prompts)
    for o, r in zip(outs, ref, strict=True):
        assert len(o.output_ids) == 3
        assert o.output_ids == r.output_ids
        assert o.meta_info["prefill_batches"][0]["graph_hit"] is True
        # a CPU replay is never called a CUDA graph
        assert o.meta_info["cuda_graph"] is (device == "cuda")


def test_full_sentinels_and_slot_limit(device):
    e = engine("full", device, full_request_slots=3, buckets=(64, 384, 512))
    plan = e.resolved.plan
    assert plan.capture_request_capacity == 3
    assert plan.bucket_sizes == (64, 384)  # 512 > 128 x 3 is never captured
    assert any(d.num_tokens == 512 and "x 3" in d.reason for d in plan.dropped)
    assert plan.bucket(64).capture_seq_lens == (64, 0, 0)
    runner = e.executor.worker.runner
    _, res = prefill_logits(e, [[1, 2, 3], [4, 5]])
    assert res.record.graph_hit and res.record.bucket == 64
    buf = runner.buffers  # the replayed layout: 2 real slots, 1 sentinel
    assert buf.extend_lens.tolist() == [3, 2, 0]
    assert buf.extend_start_loc.tolist()[2] == 5
    assert torch.isfinite(res.logits).all()
    # more requests than slots: such a batch would miss, so the scheduler splits it (3 + 1)
    assert decide_replay(plan, 4, 4).miss_reason == MISS_TOO_MANY_REQUESTS
    e.last_logits.clear()
    outs = e.generate([[1], [2], [3], [4]], SamplingParams(max_new_tokens=1))
    prefills = [r.record for b, r in e.last_logits if b.command.is_prefill]
    assert [(p.num_requests, p.graph_hit) for p in prefills] == [(3, True), (1, True)]
    assert all(len(o.output_ids) == 1 for o in outs)


def test_no_legal_bucket_falls_back_to_eager(caplog):
    caplog.set_level(logging.WARNING)
    e = engine("tc_piecewise", buckets=(100_000,), chunked_prefill_size=200_000,
               max_running_requests=2)  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    (line,) = [w for w in warnings if "Disable prefill graphs" in w]
    assert "tc_piecewise" in line and "context_length 128" in line and "capacity 2" in line
    assert e.executor.worker.runner.name == "eager"
    assert e.resolved.graph_kind is None
    (out,) = e.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert len(out.output_ids) == 2
    assert out.meta_info["prefill_batches"][0]["miss_reason"] == "disabled"


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_never_writes_live_kv(backend, device):
    e = engine(backend, device, buckets=(64,))
    worker = e.executor.worker
    live = e.add([9] * 40, SamplingParams(max_new_tokens=50, ignore_eos=True))
    e.step()  # prefill the live request
    e.step()  # one decode step
    live_slots = list(live.slots)
    before = worker.kv_snapshot()
    other = e.add([5] * 10, SamplingParams(max_new_tokens=1))  # 10 tokens pad to 64
    e.step()
    assert other.prefill_records[0].padded_tokens == 54
    batch, _ = e.last_logits[-1]
    other_slots = list(batch.command.out_cache_loc)
    assert len(other_slots) == 10 and not set(other_slots) & set(live_slots)
    after = worker.kv_snapshot()
    for b, a in zip(before, after, strict=True):
        assert torch.equal(b[live_slots], a[live_slots])
        untouched = torch.ones(b.shape[0], dtype=torch.bool)
        untouched[PADDING_SLOT] = False
        untouched[other_slots] = False
        # besides the padding slot and the new request's own slots, nothing changed
        changed = (b != a).flatten(1).any(1) & untouched
        assert not changed.any()


def test_capture_progress_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="service.coordinator")
    e = engine("breakable", buckets=(32, 256))
    lines = [r.getMessage() for r in caplog.records if "Capture prefill graph [" in r.getMessage()]
    assert len(lines) == 2 and "[1/2]: bucket 256 as 2 synthetic requests [128, 128]" in lines[0]
    stats = e.resolved.to_json()["capture"][0]["buckets"]
    assert [s["num_tokens"] for s in stats] == [256, 32]
    assert all(s["seconds"] > 0 for s in stats)


def test_tc_piecewise_splits_at_every_attention_and_traces_once():
    e = engine("tc_piecewise", buckets=(24, 32, 64, 256))
    runner = e.executor.worker.runner
    assert runner.num_pieces == e.executor.worker.model.cfg.num_hidden_layers + 1
    # one symbolic trace serves all four buckets (the capture-time budget depends on it)
    assert runner.traces == 1 and runner.captured_buckets() == (24, 32, 64, 256)
    for prompt_lens in ((5,), (30,), (100, 100)):
        outs = e.generate([[3] * n for n in prompt_lens], SamplingParams(max_new_tokens=1))
        assert all(o.meta_info["prefill_batches"][0]["graph_hit"] for o in outs)
    assert runner.traces == 1  # replays never retrace


def test_tc_piecewise_compiles_each_distinct_piece_once():
    """Middle layers are one structure: with a real dynamo compile of the pieces (the `dynamo`
    piece compiler: traced, not inductor-compiled, so it is quick on CPU) the 5 pieces of the
    4-layer model compile 3 times (first, middle, last) for all buckets, and replay == eager."""
    from service.buckets import BucketPlan
    from service.ranks.runners.tc_piecewise import TcPiecewiseGraphRunner

    e = engine("tc_piecewise", buckets=(32, 64, 256))
    w = e.executor.worker
    plan: BucketPlan = e.resolved.plan
    runner = TcPiecewiseGraphRunner(
        plan,
        w.model,
        w.setup.eager_attention,
        w.setup.graph_attention,
        w.device,
        piece_compiler="dynamo",
    )
    with torch.inference_mode():
        for b in (256, 64, 32):
            runner.capture_bucket(b)
        assert runner.num_pieces == 5 and runner.piece_compiles == 3
        # replays call the pieces as plain functions, not through nn.Module dispatch: a hook on
        # a piece (fired only by a module call) must never run
        fired = []
        for piece in runner.pieces:
            piece.register_forward_pre_hook(lambda *a: fired.append(1))
        assert not any(n.op == "call_module" for n in runner._split.graph.nodes)
        batch = live_batch(w, (100, 90))
        got = runner.run(batch, decide_replay(plan, 190, 2))
        want = w.eager_runner.run(batch, decide_replay(plan, 190, 2))
    assert runner.piece_compiles == 3  # replaying never recompiles
    assert (got - want).abs().max().item() < 1e-5
    assert fired == [] and all(piece.captured[256][1].replays == 1 for piece in runner.pieces)


def test_tc_piecewise_stores_kv_inside_the_pieces(monkeypatch):
    """Between two piece replays the host launches attention only: K/V are written by the
    captured pieces (the store op at the end of each piece), never by the bound attention's
    store. A replay still leaves every layer's cache as eager leaves it."""
    from service.ranks.attention.base import AttentionBackend

    e = engine("tc_piecewise", buckets=(64,))
    w = e.executor.worker
    plan = e.resolved.plan
    batch = live_batch(w, (30, 25))
    kv = w.setup.eager_attention.kv.kv
    with torch.inference_mode():
        w.eager_runner.run(batch, decide_replay(plan, 55, 2))
        want = [t[1:56].clone() for t in kv]
        for t in kv:
            t.zero_()
        calls = []
        original = AttentionBackend.store
        monkeypatch.setattr(
            AttentionBackend, "store", lambda *a, **k: calls.append(1) or original(*a, **k)
        )
        w.runner.run(batch, decide_replay(plan, 55, 2))
    assert calls == []
    for got, ref in zip(kv, want, strict=True):
        assert torch.equal(got[1:56], ref)


def test_full_captures_each_attention_variant_and_replays_the_one_a_layout_selects():
    """A graph attention with variants (FlashInfer's: ragged without a cached prefix, paged on
    one) gets a chain of graphs per bucket and variant: a fresh batch replays the first chain
    only, a batch on a cached prefix the second only, and both equal eager."""
    from service.ranks.attention.torch_slots import TorchSlotAttention
    from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
    from service.ranks.runners.full import FullGraphRunner, launch_spans

    class TwoVariants(TorchSlotAttention):
        graph_variants = ("fresh", "on_prefix")

        def __init__(self, *args):
            super().__init__(*args)
            self.prepared: list[str] = []

        def graph_variant(self, layout):
            return "on_prefix" if any(layout.prefix_lens) else "fresh"

        def prepare(self, batch, bucket, variant="fresh", num_slots=None):
            self.prepared.append(variant)

    e = engine("full", buckets=(64,), full_request_slots=4)
    w = e.executor.worker
    plan = e.resolved.plan
    ga = TwoVariants(w.setup.eager_attention.registry, w.kv, w.req_to_token)
    runner = FullGraphRunner(plan, w.model, w.setup.eager_attention, ga, w.device)
    with torch.inference_mode():
        runner.capture_bucket(64)
        assert ga.prepared == ["fresh", "on_prefix"]
        spans = len(launch_spans(len(w.model.layers))) + 1  # the head, then the spans
        calls = runner.captured_calls(64)
        assert len(calls) == 2 * spans  # a chain per variant, a graph per span
        fresh, on_prefix = calls[:spans], calls[spans:]

        def replays(chain):  # every graph of a chain replays with it
            assert len({c.replays for c in chain}) == 1
            return chain[0].replays

        slots = list(range(1, 61))
        w.req_to_token.write(0, 0, slots[:40])
        w.req_to_token.write(1, 0, slots[40:])
        ids = [random.randrange(384) for _ in range(60)]
        first = ForwardBatch.build(
            BatchLayout(ForwardMode.EXTEND, (0, 1), (0, 0), (30, 20)), ids[:50],
            slots[:30] + slots[40:60], w.device,
        )  # fmt: skip
        decision = decide_replay(plan, 50, 2)
        got = runner.run(first, decision).clone()
        want = w.eager_runner.run(first, decision)
        assert (replays(fresh), replays(on_prefix)) == (1, 0)
        assert runner.replayed_calls(64, first.layout) == fresh
        assert (got - want).abs().max().item() < 1e-5
        # the next chunk of request 0 on its 30 cached tokens
        chunk = ForwardBatch.build(
            BatchLayout(ForwardMode.EXTEND, (0,), (30,), (10,)), ids[50:60], slots[30:40],
            w.device,
        )  # fmt: skip
        decision = decide_replay(plan, 10, 1)
        got = runner.run(chunk, decision).clone()
        want = w.eager_runner.run(chunk, decision)
        assert (replays(fresh), replays(on_prefix)) == (1, 1)
        assert (got - want).abs().max().item() < 1e-5


def test_full_launches_its_head_before_it_plans_attention(monkeypatch):
    """The chain's head (the embedding and layer 0 up to its attention) reads no attention plan:
    a replay launches it first and plans while the device runs it, then launches the spans. A
    runner that planned first, or skipped the head, fails."""
    e = engine("full", buckets=(64,), full_request_slots=4)
    w = e.executor.worker
    runner = w.runner
    batch = live_batch(w, (20, 17), seed=5)
    decision = decide_replay(e.resolved.plan, 37, 2)
    chain = runner.replayed_calls(64, batch.layout)
    seen: list[list[int]] = []
    real = runner.graph_attention.prepare

    def prepare(*args, **kwargs):
        seen.append([c.replays for c in chain])
        return real(*args, **kwargs)

    monkeypatch.setattr(runner.graph_attention, "prepare", prepare)
    with torch.inference_mode():
        got = runner.run(batch, decision).clone()
        want = w.eager_runner.run(batch, decision)
    assert seen == [[1] + [0] * (len(chain) - 1)]  # the head ran, the spans had not
    assert [c.replays for c in chain] == [1] * len(chain)
    assert (got - want).abs().max().item() < 1e-5


def test_full_launches_a_forward_as_a_chain_that_starts_with_one_layer():
    """The device starts a graph only when its launch returns (about a microsecond per node):
    ``full``'s first graph holds one layer, and each next at most twice the layers of the one
    before, so the host launches it while the device runs the earlier ones."""
    import itertools

    from service.ranks.runners.full import launch_spans

    for n in range(1, 130):
        spans = launch_spans(n)
        assert spans[0] == (0, 1) and spans[-1][1] == n
        assert all(a == b for (_, a), (b, _) in itertools.pairwise(spans))  # contiguous, in order
        sizes = [b - a for a, b in spans]
        assert all(0 < s <= 2 * p for p, s in itertools.pairwise(sizes))
        assert len(spans) <= n.bit_length()  # a handful of launches, not one per layer
    assert launch_spans(28) == ((0, 1), (1, 3), (3, 7), (7, 15), (15, 28))
