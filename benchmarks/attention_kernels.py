"""FlashInfer's two ragged-prefill kernels side by side: FA2 against FA3 (Hopper), per bucket.

Why: every prefill layer makes one attention call; at small buckets it is latency, not FLOPs
(8-9 us per layer at 256 tokens for FA3 on the H200, against a quarter of a microsecond of
arithmetic), 28 times a forward. This measures, for the benchmark model's heads, the device time
of one call of each kernel (inside a CUDA graph of ``--calls`` calls, so no launch gaps) and the
host time of each kernel's plan, on the layouts the capture service builds (one request up to
the context length, then requests of the context length).

    python benchmarks/attention_kernels.py --buckets 16,64,256,1024,2048,4096,8192

``--replan`` adds, per kernel, what the service's own replan costs the host before each
forward (``RaggedReplan`` on a CUDA-graph wrapper, as ``full`` and the segment backends plan):
the whole call, and two of its parts timed alone, FlashInfer's compiled plan call and our copy
of the indptrs to the device. What is left is our Python around them.

``--balance`` adds, for FA3, the same call after the service's SM90 schedule rewrite
(``SM90Rebalance``: FlashInfer's work items dealt again longest first) in alternating rounds,
with the host us of the rewrite and the largest difference from FlashInfer's schedule's output
(0 expected: the same items, on other CTAs); ``--lengths`` lists more batches to measure
(request lengths, batches separated by ``;``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gemm_shapes import graph_us  # device us per call inside one CUDA graph
from benchmarks.timeline import host_ms  # host ms to issue one call from an idle device
from service.buckets import partition_bucket


def ragged_plan(w: Any, heads: tuple[int, int, int]) -> Any:
    """The causal bf16 plan of wrapper ``w`` for a host query indptr (K/V ranges the same)."""
    hq, hkv, d = heads

    def plan(qo: torch.Tensor) -> None:
        w.plan(
            qo, qo, hq, hkv, d, causal=True,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
        )  # fmt: skip

    return plan


def measure(
    w: Any,
    qo: torch.Tensor,
    qkv: tuple[torch.Tensor, ...],
    heads: tuple[int, int, int],
    args: argparse.Namespace,
) -> tuple[float, float, torch.Tensor]:
    """One wrapper's device us per call, host us per plan, and its output."""
    q, k, v = qkv
    out = torch.empty_like(q)
    planned = ragged_plan(w, heads)

    def plan() -> None:
        planned(qo)

    plan()
    dev_us = graph_us(lambda: w.run(q, k, v, out=out), args.calls, args.repeats)
    plan_us = host_ms(plan, args.repeats) * 1e3
    plan()
    w.run(q, k, v, out=out)
    return dev_us, plan_us, out.float()


def replan_costs(
    kern: str, lengths: list[int], heads: tuple[int, int, int], args: argparse.Namespace
) -> dict[str, float]:
    """Host us of the service's replan for these lengths (8 request slots, sentinels 0), and of
    its module call and indptr copy alone; all from an idle device (``host_ms``)."""
    import flashinfer
    import numpy as np

    from service.ranks.attention.flashinfer_backend import GraphPlanBuffers
    from service.ranks.attention.flashinfer_replan import RaggedReplan

    dev = torch.device("cuda")
    bufs = GraphPlanBuffers.allocate(8, args.context_length, dev)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, qo_indptr_buf=bufs.qo_indptr,
        kv_indptr_buf=bufs.kv_indptr, backend=kern,
    )  # fmt: skip
    w.reset_workspace_buffer(ws, bufs.int_workspace)
    replan = RaggedReplan(w, bufs.indptrs, ragged_plan(w, heads))
    lens = np.zeros(8, dtype=np.int64)
    lens[: len(lengths)] = lengths
    replan(lens)  # through FlashInfer, recording its module call
    replan(lens)
    if not replan.fast or replan._call is None:
        return {"replan_fast": 0.0}
    call, both = replan._call, replan._both
    return {
        "replan_fast": 1.0,
        "replan_us": host_ms(lambda: replan(lens), args.repeats) * 1e3,
        "module_us": host_ms(call, args.repeats) * 1e3,
        "copy_us": host_ms(lambda: bufs.indptrs.copy_(both, non_blocking=True), args.repeats) * 1e3,
    }


def balance_rows(
    qo: torch.Tensor,
    qkv: tuple[torch.Tensor, ...],
    heads: tuple[int, int, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """FA3 with FlashInfer's schedule against the rebalanced one, ``args.rounds`` rounds each,
    alternating: device us per call (each round's), host us of the rewrite, the makespans in
    FlashInfer's cost model, and the largest output difference."""
    import flashinfer

    from service.ranks.attention.sm90_balance import makespan, snake
    from service.ranks.attention.sm90_schedule import SM90Rebalance

    q, k, v = qkv
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa3")
    plan = ragged_plan(w, heads)
    balance = SM90Rebalance(q.device, on_device=args.balance_on == "device")
    out = torch.empty_like(q)
    got: dict[str, Any] = {"fi_us": [], "ours_us": []}
    outs = {}
    for _ in range(args.rounds):
        for arm in ("fi", "ours"):
            plan(qo)
            if arm == "ours" and not balance(w, heads[2]):
                got["ours_us"].append(None)  # FlashInfer's schedule was as short
                continue
            got[f"{arm}_us"].append(graph_us(lambda: w.run(q, k, v, out=out), args.calls, 10))
            w.run(q, k, v, out=out)
            outs[arm] = out.clone()
    if "ours" in outs:
        got["max_abs_diff"] = (outs["fi"].float() - outs["ours"].float()).abs().max().item()
        plan(qo)
        got["plan_us"] = host_ms(lambda: plan(qo), args.repeats) * 1e3
        got["plan_balance_us"] = (
            host_ms(lambda: (plan(qo), balance(w, heads[2])), args.repeats) * 1e3
        )
        got["balance_us"] = balance_host_us(lambda: balance(w, heads[2]), args)
        if balance.on_device:  # the device rewrite's own time (the copy and the kernel)
            plan(qo)
            got["deal_us"] = graph_us(lambda: balance.launch(w, heads[2]), args.calls, 10)
    # the cost model's view: FlashInfer's busiest CTA, ours, and the longest item
    plan(qo)
    read = balance.planned(w, heads[2])
    if read is not None:
        costs, wi = read
        ours = snake(costs, balance.num_ctas)
        got.update(
            items=costs.shape[0],
            fi_makespan=makespan(costs, wi),
            ours_makespan=makespan(costs[ours.order], ours.work_indptr),
            longest=int(costs.max()),
            mean=float(costs.sum() / balance.num_ctas),
        )
    return got


def balance_host_us(call: Any, args: argparse.Namespace) -> float:
    """Median host us of the rewrite alone, after one plan (repeatable: the host rewrite reads
    the plan's pinned schedule and queues one copy, the device rewrite queues a copy and its
    kernel); with ``--balance-profile``, cProfile's top functions."""
    import cProfile
    import pstats
    import statistics
    import time

    samples = []
    for _ in range(200):
        t0 = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    if args.balance_profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            call()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    return statistics.median(samples)


def print_balance(name: str, got: dict[str, Any]) -> None:
    fi = [x for x in got["fi_us"] if x is not None]
    ours = [x for x in got["ours_us"] if x is not None]
    model = (
        f"model {got['fi_makespan']}/{got['ours_makespan']} (longest {got['longest']}, "
        f"mean {got['mean']:.0f}, {got['items']} items)"
        if "items" in got
        else ""
    )
    deal = f", device {got['deal_us']:.2f} us" if "deal_us" in got else ""
    if not ours:
        print(f"  {name}: kept FlashInfer's schedule; fa3 {min(fi):.2f} us  {model}", flush=True)
        return
    print(
        f"  {name}: fa3 {' '.join(f'{x:.2f}' for x in fi)} us, rebalanced "
        f"{' '.join(f'{x:.2f}' for x in ours)} us ({min(ours) / min(fi):.3f}); plan "
        f"{got['plan_us']:.1f} us, with the rewrite {got['plan_balance_us']:.1f} (alone "
        f"{got['balance_us']:.1f}{deal}); max diff "
        f"{got['max_abs_diff']:.4f}; {model}",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", default="16,64,256,1024,2048,4096,8192")
    ap.add_argument("--context-length", type=int, default=2048)
    ap.add_argument("--heads", default="12,2,128", help="query heads, KV heads, head dim")
    ap.add_argument("--kernels", default="fa2,fa3")
    ap.add_argument("--calls", type=int, default=28, help="calls per graph (the model's layers)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--replan", action="store_true", help="the service's replan, and its parts")
    ap.add_argument("--balance", action="store_true", help="FA3 with the SM90 schedule rewrite")
    ap.add_argument("--lengths", default="", help="more batches: 1000,700,348;3000,1000")
    ap.add_argument("--rounds", type=int, default=3, help="--balance: rounds of each schedule")
    ap.add_argument("--balance-profile", action="store_true", help="cProfile of the rewrite")
    ap.add_argument(
        "--balance-on", choices=("device", "host"), default="device",
        help="--balance: the rewrite's Triton kernel after the plan, or the host's numpy",
    )  # fmt: skip
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import flashinfer

    hq, hkv, d = (int(x) for x in args.heads.split(","))
    dev = torch.device("cuda")
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    kernels = args.kernels.split(",")
    rows = []
    head = " ".join(f"{k + ' us':>9} {k + ' plan':>9}" for k in kernels)
    print(f"{'bucket':>6} {'reqs':>4} {head}")
    batches = [partition_bucket(int(b), args.context_length) for b in args.buckets.split(",")]
    batches += [[int(x) for x in b.split(",")] for b in args.lengths.split(";") if b]
    for lengths in batches:
        bucket = sum(lengths)
        qo = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        qo[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
        qkv = tuple(
            torch.randn(bucket, h, d, device=dev, dtype=torch.bfloat16) for h in (hq, hkv, hkv)
        )
        row: dict = {"bucket": bucket, "requests": len(lengths)}
        outs = {}
        for kern in kernels:
            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=kern)
            dev_us, plan_us, outs[kern] = measure(w, qo, qkv, (hq, hkv, d), args)
            row[f"{kern}_us"], row[f"{kern}_plan_us"] = dev_us, plan_us
            if args.replan:
                costs = replan_costs(kern, lengths, (hq, hkv, d), args)
                row.update({f"{kern}_{k}": v for k, v in costs.items()})
        if len(outs) == 2:
            a, b = outs.values()
            row["max_abs_diff"] = (a - b).abs().max().item()
        rows.append(row)
        cells = " ".join(f"{row[k + '_us']:>9.2f} {row[k + '_plan_us']:>9.1f}" for k in kernels)
        for k in kernels if args.replan else []:  # replan us: whole / module call / our copy
            if row.get(f"{k}_replan_fast"):
                whole, module, copy = (row[f"{k}_{p}_us"] for p in ("replan", "module", "copy"))
                cells += f"  {k} replan {whole:.1f} = module {module:.1f} + copy {copy:.1f} + rest"
            else:
                cells += f"  {k} replan: no fast path"
        diff = f"  max diff {row['max_abs_diff']:.4f}" if "max_abs_diff" in row else ""
        print(f"{bucket:>6} {len(lengths):>4} {cells}{diff}", flush=True)
        if args.balance:
            row["balance"] = balance_rows(qo, qkv, (hq, hkv, d), args)
            print_balance(",".join(map(str, lengths)), row["balance"])
    if args.out:
        Path(args.out).write_text(json.dumps({
            "rows": rows, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "flashinfer": flashinfer.__version__, "args": vars(args),
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
