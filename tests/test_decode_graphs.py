"""Decode graphs: the size rules (pure, property-tested) and replay against eager decode."""

from __future__ import annotations

import itertools
import random

import httpx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from service.config import DecodeGraphConfig, EngineConfig, GraphConfig
from service.decode_sizes import (
    DecodePlan,
    agree_decode_plans,
    decide_decode,
    default_decode_sizes,
    drop_decode_sizes,
    resolve_decode_plan,
)
from service.engine import Engine
from service.errors import PlanError
from service.padding import PADDING_SLOT
from service.sampling import SamplingParams
from tests.server_proc import ServerProcess

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# ---- the rules ------------------------------------------------------------------------------
@given(st.integers(1, 2048))
def test_default_sizes_are_dense_then_sparse_and_end_at_the_pool(pool):
    sizes = default_decode_sizes(pool)
    assert list(sizes) == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == pool
    assert all(1 <= s <= pool for s in sizes)
    dense = [s for s in (1, 2, 4, 8, 12, 16, 24, 32) if s < pool]
    assert list(sizes[: len(dense)]) == dense  # every small size a batch is likely to have
    # the padding a step can need stays bounded: at most half the size below it (or 8)
    assert all(b - a <= max(8, a // 2) for a, b in itertools.pairwise(sizes))


@given(st.lists(st.integers(1, 64), min_size=1, max_size=8), st.integers(1, 80))
def test_a_step_replays_the_smallest_size_that_holds_it(sizes, batch):
    plan = resolve_decode_plan(enabled=True, max_running_requests=64, sizes=sizes)
    d = decide_decode(plan, batch)
    fits = [s for s in plan.sizes if s >= batch]
    if fits:
        assert d.hit and d.size == min(fits) and d.padded == d.size - batch
    else:
        assert not d.hit and d.miss_reason == "too_many_requests"


def test_plans_agree_drop_and_disable_with_reasons():
    a = resolve_decode_plan(enabled=True, max_running_requests=8, sizes=(1, 2, 4, 8, 16))
    assert a.sizes == (1, 2, 4, 8) and "exceeds max_running_requests 8" in a.dropped[0].reason
    b = resolve_decode_plan(enabled=True, max_running_requests=4)
    agreed = agree_decode_plans([a, b])
    assert agreed.sizes == (1, 2, 4) and agreed.max_running_requests == 4
    assert any(d.size == 8 and "not legal on every rank" in d.reason for d in agreed.dropped)
    dropped = drop_decode_sizes(agreed, {2: "rank 1: RuntimeError: boom"})
    assert dropped.sizes == (1, 4) and any("capture failed" in d.reason for d in dropped.dropped)
    off = resolve_decode_plan(enabled=False, max_running_requests=8)
    assert not off.enabled and decide_decode(off, 1).miss_reason == "disabled"
    with pytest.raises(PlanError, match="not an integer"):
        resolve_decode_plan(enabled=True, max_running_requests=8, sizes="1,x")
    assert decide_decode(DecodePlan((), 4), 3).miss_reason == "disabled"


# ---- replay against eager --------------------------------------------------------------------
def decode_engine(device: str, sizes: tuple[int, ...] | None, enabled: bool = True) -> Engine:
    e = Engine(
        EngineConfig(
            device=device, dtype="float32", context_length=96, max_running_requests=8,
            chunked_prefill_size=128, kv_cache_memory_bytes=16 << 20,
            graph=GraphConfig(backend="breakable", buckets=(64, 128)),
            decode=DecodeGraphConfig(enabled=enabled, sizes=sizes),
        )
    )  # fmt: skip
    e.return_logits = True
    return e


def run_mix(e: Engine, seed: int) -> tuple[list[list[int]], list]:
    """Requests arriving while others run and finish: the decode batch shrinks and grows."""
    rng = random.Random(seed)
    reqs = []
    for wave in range(3):
        for _ in range(rng.randint(1, 3)):
            prompt = [rng.randrange(384) for _ in range(rng.randint(1, 40))]
            n = rng.randint(1, 12)
            reqs.append(e.add(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)))
        for _ in range(rng.randint(1, 5) if wave < 2 else 1000):
            if e.step() is None:
                break
    return [r.output_ids for r in reqs], reqs


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_outputs_with_decode_graphs_equal_eager_decode(device):
    seed = random.randrange(1 << 30)
    graphs = decode_engine(device, (1, 2, 4, 8))
    eager = decode_engine(device, None, enabled=False)
    assert graphs.resolved.decode.sizes == (1, 2, 4, 8)
    assert graphs.resolved.decode_graph_kind == ("cuda" if device == "cuda" else "cpu")
    got, reqs = run_mix(graphs, seed)
    want, _ = run_mix(eager, seed)
    assert got == want, seed
    steps = [(b, r) for b, r in graphs.last_logits if not b.command.is_prefill]
    assert {r.decode_record.graph_hit for _, r in steps} == {True}
    sizes = {len(b.requests) for b, _ in steps}
    assert len(sizes) > 1, f"the decode batch never changed size (seed {seed})"
    ref = [r for b, r in eager.last_logits if not b.command.is_prefill]
    for (_, g), e in zip(steps, ref, strict=True):
        assert (g.logits - e.logits).abs().max().item() < (1e-4 if device == "cuda" else 1e-5)
    assert sum(r.decode_graph_steps for r in reqs) == sum(len(b.requests) for b, _ in steps)


def test_padded_decode_slots_never_touch_live_kv():
    e = decode_engine("cpu", (4,))
    worker = e.executor.worker
    reqs = [
        e.add([7 + i] * 10, SamplingParams(max_new_tokens=5, ignore_eos=True)) for i in range(3)
    ]
    e.step()  # the prefill of all three
    before = worker.kv_snapshot()
    live = [s for r in reqs for s in r.slots]
    e.step()  # one decode step: 3 live + 1 padded slot in the size-4 graph
    batch, result = e.last_logits[-1]
    assert result.decode_record.size == 4 and result.decode_record.padded == 1
    new = list(batch.command.out_cache_loc)
    after = worker.kv_snapshot()
    for b, a in zip(before, after, strict=True):
        assert torch.equal(b[live], a[live])  # earlier tokens of the live requests
        changed = (b != a).flatten(1).any(1)
        changed[new] = False
        changed[PADDING_SLOT] = False
        assert not changed.any()  # only the three new tokens and the padding slot were written


def test_a_batch_above_the_largest_size_runs_eagerly_and_says_why(tmp_path):
    server = ServerProcess(
        "--context-length", "128", "--max-running-requests", "4", "--prefill-buckets", "64",
        "--decode-graphs", "on", "--decode-graph-sizes", "1,2", log_path=tmp_path / "log",
    )  # fmt: skip
    try:
        info = httpx.get(server.url + "/server_info", timeout=10).json()
        assert info["decode_graphs"]["sizes"] == [1, 2]
        before = server.metric("capture_service_decode_steps_total", result="miss",
                               reason="too_many_requests")  # fmt: skip
        body = {
            "input_ids": [[1, 2], [3, 4], [5, 6]],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        }
        r = httpx.post(server.url + "/generate", json=body, timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        for answer in r.json():
            steps = answer["meta_info"]["decode_steps"]
            assert steps == {"graph": 0, "eager": 3}  # three requests: above the largest size
        after = server.metric("capture_service_decode_steps_total", result="miss",
                              reason="too_many_requests")  # fmt: skip
        assert after == before + 3
        (one,) = httpx.post(server.url + "/generate", json={**body, "input_ids": [[9, 9]]},
                            timeout=60).json()  # fmt: skip
        assert one["meta_info"]["decode_steps"] == {"graph": 3, "eager": 0}
        assert server.metric("capture_service_decode_steps_total", result="hit", reason="none") >= 3
    finally:
        server.stop()
