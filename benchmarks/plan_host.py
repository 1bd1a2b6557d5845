"""What one ragged plan costs the host before a segment runner's first attention, piece by piece,
on a CUDA sm90 GPU with FlashInfer (FA3) and triton. Not a test: median host microseconds over
``--iters`` plans of one CUDA-graph ragged wrapper (Qwen2.5-1.5B's heads, 4 request slots, the
2,048-token bucket), each from an idle device and again behind a busy one (a queued matmul of
about a millisecond), for:

- ``own``: RaggedReplan with FlashInfer's module call (the kernel's own schedule);
- ``deal``: the same, then the schedule dealt again on the device (sm90_schedule's deal kernel);
- ``planner``: RaggedReplan with the device planner in place of the module call;
- ``planner graph``: RaggedReplan replaying the indptr copy and the planner as one captured
  graph (what the segment backends do since session 48);
- the planner's pieces: the indptr copy alone, ``SM90Rebalance.plan`` alone, the Triton launch
  alone, and the same launch replayed from a CUDA graph.

    python benchmarks/plan_host.py --iters 300 --out /tmp/plan_host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

HEADS = (12, 2, 128)
SLOTS, BUCKET = 4, 2048
LAYOUTS = {"[2048]": [2048, 0, 0, 0], "[1400, 600]": [1400, 600, 0, 0]}


def _wrapper(dev: torch.device):
    import flashinfer

    from service.ranks.attention.flashinfer_backend import GraphPlanBuffers

    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    bufs = GraphPlanBuffers.allocate(SLOTS, BUCKET, dev)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, qo_indptr_buf=bufs.qo_indptr,
        kv_indptr_buf=bufs.kv_indptr, backend="fa3",
    )  # fmt: skip
    w.reset_workspace_buffer(ws, bufs.int_workspace)
    hq, hkv, d = HEADS

    def plan(qo: torch.Tensor) -> None:
        w.plan(qo, qo, hq, hkv, d, causal=True, sm_scale=d**-0.5,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip

    return w, bufs, plan


def _time(fn: Callable[[], object], iters: int, busy: Callable[[], None] | None) -> float:
    samples = []
    for i in range(iters + 5):
        torch.cuda.synchronize()
        if busy is not None:
            busy()
        t = time.perf_counter_ns()
        fn()
        e = time.perf_counter_ns()
        if i >= 5:
            samples.append((e - t) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from service.ranks.attention.flashinfer_replan import RaggedReplan
    from service.ranks.attention.sm90_schedule import SM90Rebalance

    dev = torch.device("cuda")
    hq, _, d = HEADS
    balance = SM90Rebalance(dev)
    print(f"device planner trusted: {balance.plans_on_device}; deal on the device: "
          f"{balance.on_device}; {balance.num_ctas} CTAs")  # fmt: skip
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def busy() -> None:  # about a millisecond of queued device work on an H100 / H200
        torch.mm(a, a)

    replans = {}
    for name in ("own", "deal", "planner", "planner graph"):
        w, bufs, plan = _wrapper(dev)
        after = (lambda same, w=w: balance(w, d, same)) if name != "own" else None
        indptr = bufs.indptrs[0]

        def device_plan(lengths: np.ndarray, w=w, indptr=indptr) -> bool:
            return balance.plan(w, hq, d, indptr, lengths)

        def graph_plan(lengths: np.ndarray, w=w) -> bool:
            return balance.replay_plan(w, hq, d, lengths)

        planner = name.startswith("planner")
        r = RaggedReplan(w, bufs.indptrs, plan, after=after,
                         device_plan=device_plan if planner else None,
                         graph_plan=graph_plan if name == "planner graph" else None)  # fmt: skip
        r(np.array(LAYOUTS["[2048]"]))  # the capture's plan
        if name == "planner graph" and not balance.capture_plan(
            w, hq, d, bufs.indptrs, r.host_indptrs
        ):
            print("planner graph: not captured (the planner is not trusted here)")
        replans[name] = (r, w, bufs)

    w, bufs = replans["planner"][1], replans["planner"][2]
    got = balance._layout(w, True)

    def launch() -> None:  # the planner's launch as SM90Rebalance.plan queues it
        balance._queue_plan(got, hq, d, bufs.indptrs[0])

    launch()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        launch()
    pinned = torch.zeros(2, SLOTS + 1, dtype=torch.int32).pin_memory()

    rows = []
    for lname, lens in LAYOUTS.items():
        lengths = np.array(lens)
        pinned[:, 1:] = torch.from_numpy(np.cumsum(lens)).to(torch.int32)
        cases: dict[str, Callable[[], object]] = {
            f"replan {n}": (lambda r=replans[n][0], x=lengths: r(x)) for n in replans
        }
        cases["indptr copy alone"] = lambda: bufs.indptrs.copy_(pinned, non_blocking=True)
        cases["SM90Rebalance.plan alone"] = lambda x=lengths: balance.plan(
            w, hq, d, bufs.indptrs[0], x
        )
        cases["triton launch alone"] = launch
        cases["the launch as a graph replay"] = graph.replay
        for case, fn in cases.items():
            idle = _time(fn, args.iters, None)
            behind = _time(fn, args.iters, busy)
            rows.append({"layout": lname, "case": case, "idle_us": idle, "busy_us": behind})
            print(f"{lname:>12} {case:>30} {idle:8.1f} us idle {behind:8.1f} us behind a matmul")
    for name, (r, _, _) in replans.items():
        print(f"replan {name}: fast path {r.fast}")
    print(f"device plans {balance.device_plans}, deals applied {balance.applied}, "
          f"kept {balance.kept}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
