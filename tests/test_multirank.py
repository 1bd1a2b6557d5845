"""Multi-rank on CPU: Ray actors per rank, gloo, the coordinator's agreement and faults."""

from __future__ import annotations

import threading
import time

import pytest

from service.config import EngineConfig, GraphConfig
from service.engine import Engine
from service.executor import RankFailure
from service.ranks.actor import RankFaults
from service.ray_executor import RayExecutor
from service.sampling import SamplingParams
from tests.hf_models import make_llama

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
    )


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_tp")
    make_llama(out)
    return str(out)


@pytest.mark.parametrize("backend", ["full", "breakable", "tc_piecewise"])
@pytest.mark.parametrize("model", ["builtin", "hf"])
def test_tp2_matches_tp1(ray_local, backend, model, hf_llama):
    path = hf_llama if model == "hf" else None
    ref = Engine(cfg(1, backend, path)).generate(PROMPTS, GREEDY)
    engine = Engine(cfg(2, backend, path))
    try:
        assert engine.resolved.tp == 2
        outs = engine.generate(PROMPTS, GREEDY)
    finally:
        engine.shutdown()
    assert [o.output_ids for o in outs] == [r.output_ids for r in ref]
    rec = outs[0].meta_info["prefill_batches"][0]
    assert rec["graph_hit"] and rec["bucket"] == 128 and rec["graph_kind"] == "cpu"


def test_agreed_buckets_are_the_intersection(ray_local):
    c = cfg(2, "breakable", max_running_requests=4)
    # rank 1 has a pool of 2: 256 > 64 x 2 is illegal there, so no rank captures it
    executor = RayExecutor(c, faults={1: RankFaults(max_running_requests=2)})
    engine = Engine(c, executor=executor)
    try:
        info = engine.resolved.to_json()
        assert [b["num_tokens"] for b in info["buckets"]] == [32, 128]
        assert info["max_running_requests"] == 2
        dropped = {d["num_tokens"]: d["reason"] for d in info["dropped_buckets"]}
        assert "not legal on every rank (rank 1: bucket 256 exceeds" in dropped[256]
        assert "64 x 2" in dropped[256]
        outs = engine.generate([[1] * 64, [2] * 60], GREEDY)  # the pool of 2 bounds a batch
        rec = outs[0].meta_info["prefill_batches"][0]
        assert rec["graph_hit"] and rec["bucket"] == 128 and rec["num_requests"] == 2
    finally:
        engine.shutdown()


def test_capture_failure_on_one_rank_drops_bucket_everywhere(ray_local):
    c = cfg(2, "breakable")
    executor = RayExecutor(c, faults={1: RankFaults(fail_capture_buckets=(128,))})
    engine = Engine(c, executor=executor)
    try:
        info = engine.resolved.to_json()
        assert [b["num_tokens"] for b in info["buckets"]] == [32, 256]
        (reason,) = [d["reason"] for d in info["dropped_buckets"] if d["num_tokens"] == 128]
        assert "capture failed" in reason and "rank 1" in reason
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
    assert errors and req.finished and req.finish_reason["type"] == "abort"
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
