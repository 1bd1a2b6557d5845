"""FlashInfer's FA3 prefill schedule dealt again (service.ranks.attention.sm90_schedule), on an
sm90 GPU: the device runs the rewritten schedule, every item once, and the attention output is
bit-identical to FlashInfer's schedule's, in a wrapper alone and through the service's graphs.

Skipped without CUDA (the `gpu` marker), without FlashInfer, or off sm90 (FA3 runs there only).
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from service.ranks.select import flashinfer_import_error


def _needs_fa3():
    if not torch.cuda.is_available():
        return pytest.mark.skip(reason="gpu: needs a CUDA device; none on this machine")
    err = flashinfer_import_error()
    if err is not None:
        return pytest.mark.skip(reason=f"needs FlashInfer (the gpu extra): {err}")
    major = torch.cuda.get_device_capability()[0]
    return pytest.mark.skipif(major != 9, reason=f"FA3 runs on sm90 only, not sm{major}x")


pytestmark = [pytest.mark.gpu, _needs_fa3()]

HEADS = (12, 2, 128)  # Qwen2.5-1.5B's query heads, KV heads, head dim


def _triton_missing() -> str | None:
    from service.ranks.select import triton_import_error

    return triton_import_error()


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("lens", [[2048], [1000, 700, 348], [3000, 1000, 50, 48], [4096]])
def test_the_rewritten_schedule_runs_every_item_once_with_the_same_output(lens, on_device):
    import flashinfer

    from service.ranks.attention.sm90_balance import item_costs, makespan
    from service.ranks.attention.sm90_schedule import SM90Rebalance
    from tests.test_sm90_balance import device_schedule

    dev = torch.device("cuda")
    hq, hkv, d = HEADS
    t = sum(lens)
    gen = torch.Generator(device=dev).manual_seed(len(lens))
    q, k, v = (torch.randn(t, h, d, device=dev, dtype=torch.bfloat16, generator=gen)
               for h in (hq, hkv, hkv))  # fmt: skip
    qo = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    w.plan(qo, qo, hq, hkv, d, causal=True, q_data_type=torch.bfloat16)
    if on_device and _triton_missing():
        pytest.skip(f"the device rewrite needs triton: {_triton_missing()}")
    balance = SM90Rebalance(dev, on_device=on_device)
    theirs, their_wi = device_schedule(w, balance)
    want = w.run(q, k, v)
    assert balance(w, d)
    ours, our_wi = device_schedule(w, balance)
    # the same items (request, tile, head and their ranges), each once, on other CTAs
    assert sorted(map(tuple, ours.tolist())) == sorted(map(tuple, theirs.tolist()))
    assert not np.array_equal(our_wi, their_wi)

    def busiest(items: np.ndarray, wi: np.ndarray) -> int:  # columns: tile, ..., qo_len, kv_len
        return makespan(item_costs(items[:, 0], items[:, 3], items[:, 4]), wi.astype(np.int64))

    assert busiest(ours, our_wi) < busiest(theirs, their_wi)
    assert torch.equal(w.run(q, k, v), want)
    assert balance.applied == 1
    if on_device:  # the kernel's schedule is the host rewrite's, array for array
        w.plan(qo, qo, hq, hkv, d, causal=True, q_data_type=torch.bfloat16)
        assert SM90Rebalance(dev, on_device=False)(w, d)
        host, host_wi = device_schedule(w, balance)
        assert np.array_equal(host, ours) and np.array_equal(host_wi, our_wi)


@pytest.mark.parametrize(
    ("probe", "trusted", "what"),
    [("device_rewrite_error", "on_device", "the device rewrite"),
     ("device_plan_error", "plans_on_device", "the planner")],
)  # fmt: skip
def test_the_start_up_probes_trust_the_device_kernels_here(probe, trusted, what):
    """On sm90 with triton the probe plan is dealt on the device exactly as on the host, and the
    planner writes the reference's schedule for the probe's slots, so a rank that asks for the
    balanced schedule deals and plans it on the device."""
    from service.ranks.attention import sm90_schedule

    if _triton_missing():
        pytest.skip(f"{what} needs triton: {_triton_missing()}")
    dev = torch.device("cuda")
    num_ctas = torch.cuda.get_device_properties(dev).multi_processor_count
    assert getattr(sm90_schedule, probe)(dev, num_ctas) is None
    assert getattr(sm90_schedule.SM90Rebalance(dev), trusted)


@pytest.mark.parametrize("lens", [[2048], [1000, 700, 348], [3000, 0, 1000, 50, 48], [4096]])
def test_the_planner_replaces_flashinfers_plan_with_the_same_output(lens):
    """A wrapper planned by FlashInfer for one request of 8,192 rows (its arrays sized as a
    graph wrapper's are, for the largest batch), then planned on the device for ``lens``: its
    arrays hold the items of FlashInfer's own plan of ``lens`` (another wrapper's), each once,
    its busiest CTA no busier, and the attention output is bit-identical to that plan's."""
    import flashinfer

    from service.ranks.attention.sm90_balance import item_costs, makespan
    from service.ranks.attention.sm90_schedule import SM90Rebalance
    from tests.test_sm90_balance import device_schedule

    if _triton_missing():
        pytest.skip(f"the planner needs triton: {_triton_missing()}")
    dev = torch.device("cuda")
    hq, hkv, d = HEADS
    t, bucket = sum(lens), 8192
    gen = torch.Generator(device=dev).manual_seed(len(lens))
    q, k, v = (torch.randn(bucket, h, d, device=dev, dtype=torch.bfloat16, generator=gen)
               for h in (hq, hkv, hkv))  # fmt: skip
    qo = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    ref, w = (
        flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            torch.zeros(128 << 20, dtype=torch.uint8, device=dev), "NHD", backend="fa3"
        )
        for _ in range(2)
    )
    ref.plan(qo, qo, hq, hkv, d, causal=True, q_data_type=torch.bfloat16)
    balance = SM90Rebalance(dev)
    assert balance.plans_on_device
    theirs, their_wi = device_schedule(ref, balance)
    want = ref.run(q[:t], k[:t], v[:t])
    # w planned by FlashInfer for the bucket's rows as one request (its arrays sized for the
    # largest batch, as a graph wrapper's are), then on the device for ``lens`` in its first rows
    whole = torch.tensor([0, bucket], dtype=torch.int32)
    w.plan(whole, whole, hq, hkv, d, causal=True, q_data_type=torch.bfloat16)
    assert balance.plan(w, hq, d, qo.to(dev), np.array(lens))
    assert balance.device_plans == 1
    ours, our_wi = device_schedule(w, balance)
    assert sorted(map(tuple, ours.tolist())) == sorted(map(tuple, theirs.tolist()))

    def busiest(items: np.ndarray, wi: np.ndarray) -> int:  # columns: tile, ..., qo_len, kv_len
        return makespan(item_costs(items[:, 0], items[:, 3], items[:, 4]), wi.astype(np.int64))

    assert busiest(ours, our_wi) <= busiest(theirs, their_wi)
    assert torch.equal(w.run(q, k, v)[:t], want)  # the rows past the requests: not planned


def test_the_device_rewrite_keeps_a_schedule_it_cannot_shorten_or_read():
    """One item per CTA (nothing to gain) and CTA ranges that do not start at 0 (not a schedule
    the kernel can read): the device arrays stay FlashInfer's, byte for byte, whether the host
    skipped the launch or the kernel ran."""
    import flashinfer

    from service.ranks.attention.sm90_schedule import SM90Rebalance

    if _triton_missing():
        pytest.skip(f"the device rewrite needs triton: {_triton_missing()}")
    dev = torch.device("cuda")
    hq, hkv, d = HEADS
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    balance = SM90Rebalance(dev, on_device=True)
    for lens, corrupt in (([1024], False), ([2048], True)):
        qo = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
        w.plan(qo, qo, hq, hkv, d, causal=True, q_data_type=torch.bfloat16)
        if corrupt:  # the first CTA's range start moved off 0 on the device
            layout, _, region = balance._layout(w, False)
            region[layout.at["work_indptr"] - layout.start] = 1
        before = w._int_workspace_buffer.clone()
        # [1024]: 96 items, not even queued (the host reads the count); queued anyway, by
        # launch (as a capture queues it), the kernel's own check keeps it
        assert balance(w, d) == corrupt
        balance.launch(w, d)
        torch.cuda.synchronize()
        assert torch.equal(w._int_workspace_buffer, before), lens


def test_the_service_replays_the_dealt_schedule_bit_for_bit(tmp_path):
    """A model with Qwen2.5-1.5B's heads (12 query heads: 192 work items at 2,048 tokens, more
    than the SMs), `full` and `breakable`, the balanced schedule against FlashInfer's: the same
    logits bit for bit, and the balanced engines really rewrote their plans; `breakable`'s
    256-token bucket (at most 12 x 5 items over its 4 slots, fewer than the SMs) is planned as
    FlashInfer plans it, with no schedule work after its plans."""
    from service.config import EngineConfig, GraphConfig
    from service.engine import Engine
    from tests.fi_model import FI_CONFIG, write_fi_model

    model = write_fi_model(tmp_path / "m")
    heads = {"hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2}
    cfg_json = {**FI_CONFIG, **heads, "intermediate_size": 2048, "num_hidden_layers": 2}
    (model / "config.json").write_text(json.dumps(cfg_json))
    base = EngineConfig(
        model_path=str(model), load_format="random", dtype="bfloat16", device="cuda",
        context_length=4096, max_running_requests=4, chunked_prefill_size=4096,
        kv_cache_memory_bytes=256 << 20, attention_backend="flashinfer",
    )  # fmt: skip
    from tests.test_flashinfer import prefill_results

    rng = random.Random(7)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (2040, 1400, 600)]
    short = [[rng.randrange(384) for _ in range(200)]]

    for backend in ("full", "breakable"):
        buckets = (2048,) if backend == "full" else (256, 2048)
        graph = GraphConfig(backend=backend, buckets=buckets,
                            full_request_slots=2 if backend == "full" else None)  # fmt: skip
        logits = {}
        for schedule in ("balanced", "own"):
            e = Engine(replace(base, graph=graph, prefill_schedule=schedule))
            try:
                assert e.resolved.limits.prefill_schedule.name == schedule
                e.return_logits = True
                # the short prompt first: the buckets share the plan buffers, and the last
                # batch's indptrs are checked below
                got = prefill_results(e, short) if backend == "breakable" else []
                got += prefill_results(e, [prompts[0]]) + prefill_results(e, prompts[1:])
                assert all(r.record.graph_hit for _, r in got)
                logits[schedule] = [r.logits for _, r in got]
                # the attention the replays planned: `full`'s graph attention, the segment
                # runner's own planned wrappers for `breakable`
                w = e.executor.worker
                used = w.setup.graph_attention if backend == "full" else w.runner.attention.planned
                assert (used.balance is not None) == (schedule == "balanced"), backend
                if used.balance is not None:
                    wrapper = used._wrappers[(2048, used.head_shapes[0], "ragged")]
                    _assert_dealt(wrapper, used, backend, last=[1400, 600])
                if used.balance is not None and backend == "breakable":
                    small = used._replans[(256, used.head_shapes[0])]
                    assert not small.plans_on_device and small._after is None
                    assert id(small.wrapper) not in used.balance._plan_graphs
            finally:
                e.shutdown()
        for a, b in zip(logits["balanced"], logits["own"], strict=True):
            assert torch.equal(a, b), backend


def _assert_dealt(wrapper, attention, backend: str, last: list[int] | None = None) -> None:
    """The schedule the last replay's attention read (the device int workspace) is the dealt
    one. Where the planner runs (this GPU's probe trusted it), FlashInfer's host plan was
    skipped: the arrays hold sm90_balance.planned's schedule of the slots in the indptr the
    replay read, array for array, its busiest CTA no busier than FlashInfer's heap would have
    made it, and the planner really ran (captured in `full`'s graph, replayed by `breakable` as
    one graph with the indptr copy, which read ``last``'s lengths, the last batch's).
    Else the same items as FlashInfer's last plan (its pinned buffer) with a shorter busiest
    CTA: FlashInfer's copy rewrote the device arrays at that plan, so only a rewrite after it
    (the captured kernel, in `full`) can have left them dealt."""
    from service.ranks.attention.sm90_balance import item_costs, makespan, planned
    from tests.test_sm90_balance import device_schedule, flashinfer_items

    balance = attention.balance
    torch.cuda.synchronize()
    ours, our_wi = device_schedule(wrapper, balance)
    mine = makespan(item_costs(ours[:, 0], ours[:, 3], ours[:, 4]), our_wi.astype(np.int64))
    if balance.plans_on_device:
        replan = next(r for r in attention._replans.values() if r.wrapper is wrapper)
        lens = np.diff(replan.indptrs[0].cpu().numpy().astype(np.int64))
        if last is not None:  # the indptrs the replay read are the last batch's
            assert lens[lens > 0].tolist() == last, lens
        want = planned(lens, HEADS[0], balance.num_ctas)
        assert np.array_equal(ours, want.rows()), lens
        assert np.array_equal(our_wi, want.work_indptr), backend
        theirs, their_wi = flashinfer_items(lens.tolist(), HEADS[0], balance.num_ctas)
        assert mine <= makespan(item_costs(theirs[:, 0], theirs[:, 3], theirs[:, 4]), their_wi)
        if backend == "full":
            assert balance._captured[id(wrapper)][0] == "plan"
        else:  # the segment backend's plans: one graph of the indptr copy and the planner
            assert id(wrapper) in balance._plan_graphs and balance.device_plans >= 1, backend
        return
    costs, their_wi = balance.planned(wrapper, HEADS[2])
    assert mine < makespan(costs, their_wi.astype(np.int64)), backend
    assert balance.applied >= 1, backend
