"""Multi-rank on CPU: Ray actors per rank, gloo, the coordinator's agreement and faults."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import ray

from service.config import DecodeGraphConfig, EngineConfig, GraphConfig
from service.engine import Engine
from service.errors import RankFailure
from service.executors.ray import RayExecutor
from service.sampling import SamplingParams
from tests.faults import RankFaults, faulty_actor
from tests.hf_models import make_deepseek_v3, make_llama

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6] * 7, [2, 7, 1, 8] * 5, [42]]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def cfg(tp: int, backend: str, model: str | None = None, **kw) -> EngineConfig:
    return EngineConfig(
        model_path=model,
        tp=tp,
        device="cpu",
        dtype="float32",
        context_length=kw.pop("context_length", 64),
        max_running_requests=kw.pop("max_running_requests", 4),
        chunked_prefill_size=256,
        kv_cache_memory_bytes=16 << 20,
        collective_timeout_s=kw.pop("collective_timeout_s", 60.0),
        graph=GraphConfig(backend=backend, buckets=kw.pop("buckets", (32, 128, 256)), **kw),
        decode=DecodeGraphConfig(enabled=True),
    )


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_tp")
    make_llama(out)
    return str(out)


@pytest.fixture(scope="module")
def hf_deepseek(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepseek_tp")
    make_deepseek_v3(out)  # MLA heads and each expert's intermediate dim split over the ranks
    return str(out)


@pytest.mark.parametrize("backend", ["full", "breakable", "tc_piecewise"])
@pytest.mark.parametrize("model", ["builtin", "hf", "deepseek"])
def test_tp2_matches_tp1(ray_local, backend, model, hf_llama, hf_deepseek):
    path = {"builtin": None, "hf": hf_llama, "deepseek": hf_deepseek}[model]
    ref = Engine(cfg(1, backend, path)).generate(PROMPTS, GREEDY)
    engine = Engine(cfg(2, backend, path))
    try:
        assert engine.resolved.tp == 2
        # start-up froze each rank's heap (the model, the graphs): no collection pass over it
        frozen = ray.get([a.frozen_objects.remote() for a in engine.executor.actors])
        assert len(frozen) == 2 and all(n > 10_000 for n in frozen), frozen
        outs = engine.generate(PROMPTS, GREEDY)
    finally:
        engine.shutdown()
    assert [o.output_ids for o in outs] == [r.output_ids for r in ref]
    rec = outs[0].meta_info["prefill_batches"][0]
    assert rec["graph_hit"] and rec["bucket"] == 128 and rec["graph_kind"] == "cpu"
    # decode graphs too, agreed across ranks, with the all-reduces of both ranks inside them
    assert engine.resolved.decode.sizes == (1, 2, 4)
    assert all(o.meta_info["decode_steps"] == {"graph": 5, "eager": 0} for o in outs)


def test_agreed_buckets_are_the_intersection(ray_local):
    c = cfg(2, "breakable", max_running_requests=4)
    # rank 1 has a pool of 2: 256 > 64 x 2 is illegal there, so no rank captures it
    executor = RayExecutor(c, faulty_actor({1: RankFaults(max_running_requests=2)}))
    engine = Engine(c, executor=executor)
    try:
        info = engine.resolved.to_json()
        assert [b["num_tokens"] for b in info["buckets"]] == [32, 128]
        assert info["max_running_requests"] == 2
        assert info["decode_graphs"]["sizes"] == [1, 2]  # rank 1's pool of 2 bounds them too
        (d,) = [d for d in info["decode_graphs"]["dropped"] if d["size"] == 4]
        assert "not legal on every rank" in d["reason"]
        dropped = {d["num_tokens"]: d["reason"] for d in info["dropped_buckets"]}
        assert "not legal on every rank (rank 1: bucket 256 exceeds" in dropped[256]
        assert "64 x 2" in dropped[256]
        outs = engine.generate([[1] * 64, [2] * 60], GREEDY)  # the pool of 2 bounds a batch
        rec = outs[0].meta_info["prefill_batches"][0]
        assert rec["graph_hit"] and rec["bucket"] == 128 and rec["num_requests"] == 2
    finally:
        engine.shutdown()


@pytest.mark.parametrize("error", ["ValueError", "IndexError"])
def test_capture_failure_on_one_rank_drops_bucket_everywhere(ray_local, error):
    """Invariant 6: whatever a capture raises on one rank, that bucket is dropped on all."""
    c = cfg(2, "breakable")
    faults = RankFaults(fail_capture_buckets=(128,), capture_error=error)
    engine = Engine(c, executor=RayExecutor(c, faulty_actor({1: faults})))
    try:
        info = engine.resolved.to_json()
        assert [b["num_tokens"] for b in info["buckets"]] == [32, 256]
        (reason,) = [d["reason"] for d in info["dropped_buckets"] if d["num_tokens"] == 128]
        assert "capture failed" in reason and f"rank 1: {error}" in reason
        for actor in engine.executor.actors:  # forgotten on the rank whose capture succeeded too
            assert ray_local.get(actor.captured.remote("prefill")) == [32, 256]
        outs = engine.generate(PROMPTS[:2], GREEDY)  # 76 tokens: would be 128, now 256
        rec = outs[0].meta_info["prefill_batches"][0]
        assert rec["graph_hit"] and rec["bucket"] == 256
        (small,) = engine.generate([[5] * 20], GREEDY)
        assert small.meta_info["prefill_batches"][0]["bucket"] == 32
    finally:
        engine.shutdown()


def test_killed_rank_fails_in_flight_request_fast(ray_local):
    import ray

    engine = Engine(cfg(2, "breakable", context_length=256, collective_timeout_s=30.0))
    assert engine.health() is None
    req = engine.add([1, 2, 3], SamplingParams(max_new_tokens=10_000 // 50, ignore_eos=True))
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not req.finished:
                engine.step()
        except RankFailure as exc:
            errors.append(exc)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    time.sleep(1.0)
    assert not req.finished
    killed_at = time.monotonic()
    ray.kill(engine.executor.actors[1], no_restart=True)
    t.join(timeout=20)
    assert not t.is_alive(), "the engine hung after a rank died"
    assert time.monotonic() - killed_at < 20
    assert errors and req.finished and req.finish_reason.type == "abort"
    assert "rank 1" in req.error
    assert engine.health() is not None
    with pytest.raises(RankFailure):
        engine.generate([[1, 2]], GREEDY)
    engine.shutdown()
    # the engine can be rebuilt
    rebuilt = Engine(cfg(2, "breakable"))
    try:
        assert rebuilt.health() is None
        assert len(rebuilt.generate([[1, 2]], GREEDY)[0].output_ids) == 6
    finally:
        rebuilt.shutdown()


def test_a_one_sided_failure_before_a_collective_fails_start_up_with_its_cause(ray_local):
    """Rank 1 fails before its capture's first collective, so rank 0 waits inside one: the
    process group is out of step, start-up fails within the collective timeout (no rank waits
    forever), and the message leads with rank 1's own error."""
    c = cfg(2, "breakable", collective_timeout_s=5.0)
    faults = RankFaults(fail_capture_buckets=(256,), capture_error="ValueError",
                        fail_capture_at="start")  # fmt: skip
    t0 = time.monotonic()
    executor = RayExecutor(c, faulty_actor({1: faults}))
    with pytest.raises(RankFailure) as err:
        Engine(c, executor=executor)
    assert time.monotonic() - t0 < 60
    msg = str(err.value)
    assert msg.startswith("capture of prefill size 256 left the ranks' collectives out of step: ")
    assert msg.index("rank 1: ValueError: injected failure") < msg.index("rank 0")


def test_capture_barriers_line_up_the_ranks(ray_local):
    """Invariant 6: every rank enters a capture together and leaves it together. Rank 1 arrives
    1 s late and spends 1 s more inside the capture; rank 0 must wait for it at both barriers."""
    c = cfg(2, "breakable", buckets=(32,))
    faults = RankFaults(arrive_late_s=1.0, capture_extra_s=1.0)
    engine = Engine(c, executor=RayExecutor(c, faulty_actor({1: faults})))
    try:
        r0, r1 = (
            {(kind, n): t for kind, n, t in ray_local.get(a.timeline.remote())}
            for a in engine.executor.actors
        )
    finally:
        engine.shutdown()
    assert r1[("arrive", 32)] - r0[("arrive", 32)] > 0.9  # the fault worked
    # entry barrier: rank 0 starts capturing only once rank 1 has arrived
    assert r0[("capture_start", 32)] >= r1[("arrive", 32)] - 0.05
    # exit barrier: rank 0 returns only once rank 1 has finished its capture
    assert r0[("return", 32)] >= r1[("capture_end", 32)] - 0.05


def test_a_hung_rank_fails_the_step_within_the_step_timeout(ray_local):
    """A rank that stops answering mid-forward fails the step after --step-timeout, with the
    rank named, instead of hanging every request (the per-rank step deadline)."""
    c = replace(cfg(2, "breakable"), step_timeout_s=2.0)
    engine = Engine(c, executor=RayExecutor(c, faulty_actor({1: RankFaults(hang_execute_from=2)})))
    try:
        req = engine.add([1, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True))
        engine.step()  # the prefill (forward 1) runs
        errors: list[BaseException] = []

        def step() -> None:
            try:
                engine.step()  # forward 2 hangs on rank 1
            except RankFailure as exc:
                errors.append(exc)

        t0 = time.monotonic()
        t = threading.Thread(target=step, daemon=True)
        t.start()
        t.join(timeout=15)
        assert not t.is_alive(), "the step waited past its deadline"
        assert 1.8 < time.monotonic() - t0 < 6
        # rank 0 waits for rank 1 inside an all-reduce, so neither answers
        assert errors and "ranks [0, 1] did not answer within 2 s" in str(errors[0])
        assert req.finished and req.finish_reason.type == "abort"
        assert engine.health() is not None
    finally:
        engine.shutdown()
