"""The scheduler's batch forming, pure Python: bucket-aware budgets and the hit they buy."""

from __future__ import annotations

from service.buckets import ResolvedRequestPool, resolve_plan
from service.commands import ForwardResult
from service.sampling import SamplingParams
from service.scheduling.scheduler import Scheduler


def scheduler(backend: str, buckets: tuple[int, ...] | None, chunk: int = 512) -> Scheduler:
    plan = resolve_plan(backend=backend, context_length=256, pool=ResolvedRequestPool(4),
                        max_prefill_tokens=chunk, buckets=buckets)  # fmt: skip
    return Scheduler(plan=plan, context_length=256, max_running_requests=4, num_kv_slots=4096,
                     chunked_prefill_size=chunk, vocab_size=100, eos_token_ids=())  # fmt: skip


def prefill_batches(s: Scheduler) -> list[tuple[int, bool]]:
    """(tokens, graph hit) of every prefill batch until all prompts are prefilled."""
    out = []
    while s.waiting:
        batch = s.schedule()
        cmd = batch.command
        assert cmd.is_prefill
        out.append((len(cmd.input_ids), cmd.decision.hit))
        s.process(batch, ForwardResult((1,) * len(batch.requests), None))
    return out


def test_batches_never_grow_past_the_largest_bucket():
    """With graphs on, the token budget is capped at the largest captured bucket: a 200-token
    prompt is chunked to fit 64 instead of forming a batch that would miss (too_many_tokens)."""
    s = scheduler("breakable", (32, 64))
    s.add([1] * 200, SamplingParams(max_new_tokens=1))
    s.add([2] * 10, SamplingParams(max_new_tokens=1))
    batches = prefill_batches(s)
    assert batches == [(64, True), (64, True), (64, True), (18, True)]


def test_without_graphs_the_budget_is_the_chunked_prefill_size():
    s = scheduler("eager", None)
    s.add([1] * 200, SamplingParams(max_new_tokens=1))
    s.add([2] * 10, SamplingParams(max_new_tokens=1))
    assert prefill_batches(s) == [(210, False)]


def test_a_slot_freed_twice_is_refused():
    """A double free would hand the same KV slots to two requests: it fails loudly."""
    import pytest

    from service.scheduling.allocators import SlotAllocator

    a = SlotAllocator(8)
    got = a.alloc(3)
    a.free(got)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(got[:1])
    with pytest.raises(ValueError, match="out of range"):
        a.free([0])  # the padding slot is never handed out
    assert a.num_free == 8


def test_running_out_of_kv_retracts_instead_of_aborting():
    """Decode that runs out of KV gives the last-admitted request's KV back and requeues it; it
    resumes by recomputing, nothing is lost, and every request gets all its tokens, the same
    greedy tokens as with plenty of KV."""
    from service.config import EngineConfig, GraphConfig
    from service.engine import Engine

    def run(kv_bytes: int) -> tuple[list[list[int]], Engine]:
        e = Engine(EngineConfig(device="cpu", dtype="float32", context_length=64,
                                max_running_requests=4, kv_cache_memory_bytes=kv_bytes,
                                graph=GraphConfig(backend="eager")))  # fmt: skip
        prompts = [[(7 * i + j) % 256 for j in range(10)] for i in range(3)]
        outs = e.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
        return [o.output_ids for o in outs], e

    # the built-in model keeps 4 KiB of K/V per token: 65 slots hold 130 of the 150 tokens
    tight, e = run(66 * 4096)
    assert e.resolved.num_kv_slots == 65
    assert e.scheduler.num_retractions >= 1
    assert all(len(ids) == 40 for ids in tight)
    plenty, _ = run(16 << 20)
    assert tight == plenty


def test_admission_keeps_room_for_the_output_of_running_requests():
    """A prompt is admitted only while the KV cache keeps half of what the admitted requests may
    still generate; the first request of an idle engine is always admitted."""
    from service.buckets import ResolvedRequestPool, resolve_plan
    from service.scheduling.scheduler import NEW_TOKEN_RATIO

    plan = resolve_plan(backend="eager", context_length=64, pool=ResolvedRequestPool(4),
                        max_prefill_tokens=64)  # fmt: skip
    s = Scheduler(plan=plan, context_length=64, max_running_requests=4, num_kv_slots=64,
                  chunked_prefill_size=64, vocab_size=100, eos_token_ids=())  # fmt: skip
    reqs = [s.add([1] * 10, SamplingParams(max_new_tokens=40)) for _ in range(3)]
    batch = s.schedule()
    # 64 slots: 10 + 20 reserved for the first, 10 + 20 for the second; the third waits
    assert NEW_TOKEN_RATIO == 0.5 and len(batch.requests) == 2
    assert reqs[2] in s.waiting and reqs[2].row is None
