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
