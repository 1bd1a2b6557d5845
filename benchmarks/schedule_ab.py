"""Two prefill schedules (or two values of another rank setting) in ONE process, timed
alternately.

Why: sessions 48-49 compared the own and balanced schedules across processes, and the processes'
hosts differed more than the schedules could (the same Python loop 40-47 us in some processes,
60-99 in others; eager prefill 10-13 ms against 16-28), skewed toward one arm for a reason not
found. Here both arms live in one process: two ranks set up from the same config but for the
setting under test (the same seed, so the same random weights), each with its own captured
graphs of the same buckets, replayed in alternating rounds (the arms' order swapped every round)
on one host, one clock and one heap. Each arm's replay is checked against the other's logits
(the schedules keep FlashInfer's work items, so they must agree bit for bit).

    python benchmarks/schedule_ab.py --arms own,balanced --buckets 16,256,2048 --out ab.json
    python benchmarks/schedule_ab.py --field gate_up_kernel --arms triton,torch   # another flag

With ``--field`` other than the schedule the logits are compared but need not be equal (another
kernel may round differently); the table says whether they were.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.host_speed import python_loop_us
from benchmarks.prefill_graphs import QWEN25_15B, logits_step, real_batch
from benchmarks.timeline import one_call_ms
from service.buckets import BucketPlan, ResolvedRequestPool, decide_replay, partition_bucket
from service.capture_result import CaptureStat
from service.config import DecodeGraphConfig, EngineConfig, GraphConfig
from service.decode_sizes import DecodePlan
from service.ranks.startup import set_up_rank
from service.ranks.worker import RankWorker

# EngineConfig field -> the RankInfo choice that reports it
CHOICES = {
    "prefill_schedule": "prefill_schedule", "attention_backend": "attention",
    "fused_kernels": "kernels", "gate_up_kernel": "gate_up", "rope_store_kernel": "rope_store",
    "splitk_norm_kernel": "splitk_norm",
}  # fmt: skip


def _rope_bias(adds: bool) -> Callable[[RankWorker], None]:
    """The tweak that has the rotary + K/V store kernel add qkv's bias wherever it runs (not
    compiled) and the GEMM run without its epilogue (``adds``), or the GEMM add it at every size
    (not ``adds``): the fold's A/B from either side, whatever rope_store_policy says."""
    name = "bias_in_rope" if adds else "bias_in_gemm"

    def tweak(worker: RankWorker) -> None:
        kernels = worker.model.kernels
        if getattr(kernels, "_rope_store", None) is None:
            raise SystemExit(f"--tweak {name} needs the rotary + K/V store kernel")

        def rope_adds_bias(rows: int) -> bool:
            return adds and not torch.compiler.is_compiling()

        kernels.rope_adds_bias = rope_adds_bias  # type: ignore[method-assign]

    return tweak


def _small_plans_on_device(worker: RankWorker) -> None:
    """Segment backends plan buckets of at most one item per CTA with the planner graph, not
    FlashInfer's host plan."""
    planned = getattr(getattr(worker.runner, "attention", None), "planned", None)
    balance = getattr(planned, "balance", None)
    if balance is None:
        raise SystemExit("--tweak small_plans_on_device needs a segment backend's balanced plan")
    balance.small_plans_on_device = True


# --tweak: a change made to the second arm's rank only, before its capture (both arms take the
# first value of --arms), for what no EngineConfig field chooses
TWEAKS = {
    "bias_in_rope": _rope_bias(True), "bias_in_gemm": _rope_bias(False),
    "small_plans_on_device": _small_plans_on_device,
}  # fmt: skip


def arm_worker(
    base: EngineConfig, field: str, value: str, buckets: tuple[int, ...], tweak: str | None = None
) -> tuple[RankWorker, BucketPlan]:
    """A rank with ``field`` set to ``value`` (and ``tweak`` applied), its graphs of
    ``buckets`` captured, and its plan."""
    worker = RankWorker(set_up_rank(replace(base, **{field: value})))
    info = worker.info
    plan = base.graph.plan(
        context_length=info.context_length,
        pool=ResolvedRequestPool(info.max_running_requests),
        max_prefill_tokens=info.chunked_prefill_size,
    )
    worker.build_runners(plan, DecodePlan((), info.max_running_requests))
    if tweak is not None:
        TWEAKS[tweak](worker)
    for b in sorted(buckets, reverse=True):
        stat = worker.capture("prefill", b)
        if not isinstance(stat, CaptureStat):
            raise RuntimeError(f"{field}={value}: capture of bucket {b} failed: {stat}")
    return worker, plan


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--field", default="prefill_schedule", help="the EngineConfig field to vary")
    ap.add_argument("--arms", default="own,balanced", help="the field's two values")
    ap.add_argument("--tweak", choices=sorted(TWEAKS), default=None,
                    help="instead of a field: both arms as the first of --arms, the second "
                         "with this change")  # fmt: skip
    ap.add_argument("--backend", default="breakable")
    ap.add_argument("--buckets", default="16,256,2048")
    ap.add_argument("--iters", type=int, default=40, help="timed calls per arm and bucket")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="the built-in model (CPU smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    values = args.arms.split(",")
    if len(values) != 2:
        raise SystemExit(f"--arms takes two values, not {values}")
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"graph", "decode"}
    if args.field not in fields:
        raise SystemExit(
            f"--field {args.field!r} is not a flat EngineConfig field: {sorted(fields)}"
        )
    tweaks: list[str | None] = [None, None]
    if args.tweak is not None:  # the first value for both, the change on the second
        values, tweaks = [values[0], values[0]], [None, args.tweak]
        arms = [values[0], f"{values[0]}+{args.tweak}"]
    # labels: the value, numbered where both arms take the same one (an A/A run)
    elif values[0] != values[1]:
        arms = values
    else:
        arms = [f"{values[0]}#{i}" for i in (1, 2)]
    buckets = tuple(int(b) for b in args.buckets.split(","))
    cuda = torch.cuda.is_available()
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(QWEN25_15B))
    base = EngineConfig(
        model_path=None if args.tiny else str(tmp),
        load_format="auto" if args.tiny else "random",
        context_length=2048, max_running_requests=8, chunked_prefill_size=8192,
        kv_cache_memory_bytes=2 << 30 if cuda else 128 << 20,
        decode=DecodeGraphConfig(enabled=False), graph=GraphConfig(args.backend, buckets),
    )  # fmt: skip
    rows = []
    with torch.inference_mode():
        pairs = zip(arms, values, tweaks, strict=True)
        ranks = {arm: arm_worker(base, args.field, v, buckets, t) for arm, v, t in pairs}
        # the rank's choice for the field where it reports one (with its reason), else the value
        reasons = {
            arm: getattr(getattr(w.info, CHOICES.get(args.field, ""), None), "reason", value)
            for (arm, (w, _)), value in zip(ranks.items(), values, strict=True)
        }
        for b in buckets:
            lens = list(partition_bucket(b, base.context_length))
            steps, outs = {}, {}
            for arm, (w, plan) in ranks.items():
                decision = decide_replay(plan, b, len(lens))
                steps[arm] = logits_step(w, w.runner, real_batch(w, lens), decision)
                outs[arm] = steps[arm]()
            same = torch.equal(outs[arms[0]], outs[arms[1]])
            for fn in steps.values():  # warm both
                for _ in range(3):
                    fn()
            samples: dict[str, list[float]] = {arm: [] for arm in arms}
            loops = []
            per_round = max(1, args.iters // args.rounds)
            for r in range(args.rounds):
                loops.append(python_loop_us())
                order = arms if r % 2 == 0 else arms[::-1]
                for arm in order:
                    device = ranks[arm][0].device
                    samples[arm] += [one_call_ms(steps[arm], device) for _ in range(per_round)]
            med = {arm: statistics.median(v) for arm, v in samples.items()}
            row = {"bucket": b, "requests": len(lens), "logits_equal": same,
                   "python_loop_us": loops, **{f"{a}_ms": med[a] for a in arms},
                   **{f"{a}_samples": samples[a] for a in arms}}  # fmt: skip
            rows.append(row)
            delta = 100 * (med[arms[1]] / med[arms[0]] - 1)
            print(
                f"bucket {b:>5}: {arms[0]} {med[arms[0]]:.3f} ms, {arms[1]} {med[arms[1]]:.3f} ms "
                f"({delta:+.1f}%), logits equal: {same}, loop {statistics.median(loops):.0f} us",
                flush=True,
            )
            gc.collect()
    for arm in arms:
        print(f"{arm}: {reasons[arm]}")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"rows": rows, "arms": arms, "field": args.field, "reasons": reasons,
             "backend": args.backend,
             "device": torch.cuda.get_device_name() if cuda else "cpu"}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
