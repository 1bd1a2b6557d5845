"""A replay must be a replay: frozen at capture, through the captured calls and static buffers.

On CPU a captured call is a traced FX graph: the model's Python ran once, at capture. These tests
break the model's Python after capture and check that replay does not notice, that each captured
call replayed exactly once per prefill, that replays hand back the same output storage (as a CUDA
graph does), and that the live batch went through the static buffers. An implementation that
runs the live batch eagerly, or re-runs the captured Python, fails them.
"""

from __future__ import annotations

import pytest
import torch

from service.buckets import decide_replay
from service.config import EngineConfig, GraphConfig
from service.engine import Engine
from service.errors import RankFailure
from service.model import llama, rotary
from service.padding import PADDING_SLOT
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.ranks.worker import capture_failure
from tests.batches import hit_batch, live_batch
from tests.faults import FaultyLocalExecutor, RankFaults

BACKENDS = ["full", "breakable", "tc_piecewise"]
CTX = 128
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def graph_cfg(backend: str, device: str = "cpu", **graph) -> EngineConfig:
    return EngineConfig(
        device=device,
        dtype="float32",
        context_length=CTX,
        max_running_requests=8,
        chunked_prefill_size=256,
        kv_cache_memory_bytes=32 << 20,
        graph=GraphConfig(backend=backend, buckets=graph.pop("buckets", (64, 256)), **graph),
    )


def poison_model_python(monkeypatch) -> None:
    """Every Python method of the model's forward raises from now on (the output tail, which is
    eager by design, excepted)."""

    def boom(*args, **kwargs):
        raise AssertionError("the model's Python ran during a replay")

    for cls, names in [
        (llama.RMSNorm, ["forward"]),
        (llama.MLP, ["forward"]),
        (llama.Attention, ["qkv"]),
        (llama.DecoderLayer, ["pre_attention", "post_attention"]),
        (llama.CausalLM, ["forward", "first_segment", "middle_segment", "last_segment"]),
        (rotary.RotaryEmbedding, ["forward"]),
    ]:
        for name in names:
            monkeypatch.setattr(cls, name, boom)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_is_frozen_at_capture_and_goes_through_the_captured_calls(
    backend, device, monkeypatch
):
    """Invariant 7 (replay equals eager) for a replay that really is one."""
    e = Engine(graph_cfg(backend, device, full_request_slots=4 if backend == "full" else None))
    w = e.executor.worker
    runner = w.runner
    batch, decision = hit_batch(e, (37, 60, 11), 256, seed=1)
    with torch.inference_mode():
        want = w.eager_runner.run(batch, decision).clone()
        calls = runner.replayed_calls(256, batch.layout)  # the graphs this batch selects
        others = [c for c in runner.captured_calls(256) if all(c is not d for d in calls)]
        assert calls and all(c.replays == 0 for c in runner.captured_calls(256))
        first = runner.run(batch, decision)
        first_ptr, first_val = first.data_ptr(), first.clone()
        poison_model_python(monkeypatch)
        with pytest.raises(AssertionError, match="Python ran"):  # the poison works ...
            w.eager_runner.run(batch, decision)
        got = runner.run(batch, decision)  # ... and a replay never meets it
    assert [c.replays for c in calls] == [2] * len(calls)
    assert all(c.replays == 0 for c in others)  # a variant this layout does not select
    assert all(c.replays == 0 for c in runner.captured_calls(64))
    # the graphs' own output storage, overwritten in place by every replay
    assert got.data_ptr() == first_ptr
    tol = 0.0 if device == "cpu" and backend != "full" else 1e-4
    assert (got - want).abs().max().item() <= tol
    assert torch.equal(got, first_val)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_reads_the_live_batch_from_the_static_buffers(backend):
    """The padding rule (service.padding) at the buffers every graph reads."""
    e = Engine(graph_cfg(backend, full_request_slots=4 if backend == "full" else None))
    w = e.executor.worker
    lens = (20, 9)
    batch = live_batch(w, lens, seed=2)
    with torch.inference_mode():
        w.runner.run(batch, decide_replay(e.resolved.plan, 29, 2))
    buf = w.runner.buffers
    assert torch.equal(buf.input_ids[:29], batch.input_ids)
    assert torch.equal(buf.positions[:29], batch.positions)
    assert buf.input_ids[29:64].eq(0).all() and buf.positions[29:64].eq(0).all()
    assert buf.out_cache_loc[29:64].eq(PADDING_SLOT).all()
    assert buf.extend_lens[:2].tolist() == [20, 9]


@pytest.mark.parametrize("error", ["ValueError", "IndexError", "KeyError"])
def test_a_capture_that_raises_anything_drops_its_bucket(error):
    """Invariant 6 on one rank: any exception in a capture drops that bucket; start-up goes on."""
    cfg = graph_cfg("breakable")
    faults = RankFaults(fail_capture_buckets=(64,), capture_error=error)
    e = Engine(cfg, executor=FaultyLocalExecutor(cfg, faults))
    assert e.resolved.plan.bucket_sizes == (256,)
    (dropped,) = [d for d in e.resolved.plan.dropped if d.num_tokens == 64]
    assert f"capture failed: rank 0: {error}" in dropped.reason
    assert e.executor.worker.runner.captured_buckets() == (256,)
    (out,) = e.generate([[5] * 30], None)
    assert out.meta_info["prefill_batches"][0]["bucket"] == 256


def test_a_capture_that_poisons_the_device_is_a_rank_failure():
    """A CUDA error that leaves the context unusable fails the rank, with the first message."""

    def dead_device() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (again)")

    first = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RankFailure, match="rank 3: the device is unusable after capturing "
                       "bucket 4096: RuntimeError: CUDA error: an illegal memory access was "
                       r"encountered$"):  # fmt: skip
        capture_failure(first, 3, 4096, dead_device)
    ok = capture_failure(IndexError("list index out of range"), 3, 4096, lambda: None)
    assert (ok.rank, ok.error, ok.message) == (3, "IndexError", "list index out of range")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_replay_is_frozen_at_capture_too(device, monkeypatch):
    """Decode graphs obey the same contract: the step replays the captured call of its size
    (counted), hands back the capture's own output storage, and never runs the model's Python."""
    from service.config import DecodeGraphConfig
    from service.decode_sizes import decide_decode

    cfg = graph_cfg("breakable", device)
    e = Engine(EngineConfig(**{**cfg.__dict__, "decode": DecodeGraphConfig(True, (1, 2, 4))}))
    w = e.executor.worker
    lens = (30, 12, 7)  # three requests with cached prefixes, decoding one token each
    first = [1 + 100 * r for r in range(3)]
    rows = [
        (r, 0, list(range(f, f + n + 1))) for r, (f, n) in enumerate(zip(first, lens, strict=True))
    ]
    w.req_to_token.write_many(rows)
    layout = BatchLayout(ForwardMode.DECODE, (0, 1, 2), lens, (1, 1, 1))
    new_slots = [f + n for f, n in zip(first, lens, strict=True)]
    batch = ForwardBatch.build(layout, [5, 6, 7], new_slots, w.device)
    decision = decide_decode(e.resolved.decode, 3)
    assert decision.hit and decision.size == 4 and decision.padded == 1
    with torch.inference_mode():
        want = w.model.logits(w.eager_runner.run(batch, None)).clone()
        (call,) = w.decode_runner.captured_calls(4)
        first_out = w.decode_runner.run(batch, decision)
        ptr, first_val = first_out.data_ptr(), first_out.clone()
        poison_model_python(monkeypatch)
        got = w.decode_runner.run(batch, decision)
    assert call.replays == 2 and got.data_ptr() == ptr
    assert torch.equal(got, first_val)
    assert (got - want).abs().max().item() < (1e-5 if device == "cpu" else 1e-4)
