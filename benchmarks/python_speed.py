"""Which start-up step changes how fast this process runs plain Python.

Why: session 49's ``host_speed`` figures showed a pure-Python loop 1.6-1.8x slower in every
process that ran the balanced prefill schedule than in those that ran FlashInfer's (74-84 µs
against 42-47 µs, measured right after the rank's set-up, on the same CPU, with no other thread
of the process running and no waiting in the run queue). This sets a rank up step by step and
times the same loop after each step, with what could slow an interpreter down beside it: a trace
or profile function, ``sys.monitoring`` tools, ``tracemalloc``, the garbage collector's state,
and the other processes' CPU time machine-wide (an SMT sibling's load slows a core without the
scheduler counting it as waiting).

    python benchmarks/python_speed.py --schedule own --probes   # the probes in an own process
    python benchmarks/python_speed.py --schedule balanced
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.host_speed import python_loop_us


def interpreter_state() -> dict:
    """What could slow the interpreter: hooks, allocation tracing, the collector."""
    import tracemalloc

    tools = []
    mon = getattr(sys, "monitoring", None)
    if mon is not None:
        tools = [(i, mon.get_tool(i)) for i in range(6) if mon.get_tool(i)]
    return {
        "trace": repr(sys.gettrace()),
        "profile": repr(sys.getprofile()),
        "monitoring": repr(tools),
        "tracemalloc": tracemalloc.is_tracing(),
        "gc": (gc.isenabled(), gc.get_threshold(), gc.get_count()),
        "objects": len(gc.get_objects()),
        "blocks": sys.getallocatedblocks(),
    }


def busy_processes(window_s: float = 0.3, top: int = 4) -> list[tuple[str, int, float]]:
    """(name, pid, % of one CPU) of the busiest processes over ``window_s``, from procfs."""

    def ticks() -> dict[int, tuple[str, int]]:
        out = {}
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                raw = (p / "stat").read_text()
            except OSError:
                continue
            name = raw[raw.index("(") + 1 : raw.rindex(")")]
            f = raw.rsplit(")", 1)[1].split()
            out[int(p.name)] = (name, int(f[11]) + int(f[12]))
        return out

    if not Path("/proc/self/stat").exists():
        return []
    a = ticks()
    time.sleep(window_s)
    b = ticks()
    hz = 100.0
    rows = [
        (name, pid, 100.0 * (t - a[pid][1]) / hz / window_s)
        for pid, (name, t) in b.items()
        if pid in a and t > a[pid][1]
    ]
    return sorted(rows, key=lambda r: -r[2])[:top]


def measure(label: str, results: list) -> None:
    loop = python_loop_us(30, 20)
    state = interpreter_state()
    busy = busy_processes()
    results.append({"step": label, "python_loop_us": loop, **state, "busy": busy})
    hooks = ", ".join(f"{k} {state[k]}" for k in ("trace", "profile", "monitoring", "tracemalloc"))
    print(
        f"{label:>34}: loop {loop:6.1f} us | {hooks} | objects {state['objects']} | "
        f"busy {', '.join(f'{n}:{pid} {pct:.0f}%' for n, pid, pct in busy)}",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", choices=("own", "balanced"), default="own")
    ap.add_argument("--probes", action="store_true", help="run the balanced schedule's probes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results: list = []
    measure("python started", results)
    import torch

    measure("torch imported", results)
    from benchmarks.prefill_graphs import QWEN25_15B
    from service.config import DecodeGraphConfig, EngineConfig, GraphConfig
    from service.ranks.startup import set_up_rank

    measure("service imported", results)
    if not torch.cuda.is_available():
        print("no CUDA device: the rank's set-up below needs one")
        return 0
    torch.zeros(1, device="cuda")
    measure("cuda initialised", results)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(QWEN25_15B))
    cfg = EngineConfig(
        model_path=str(tmp), load_format="random", context_length=2048,
        max_running_requests=8, chunked_prefill_size=8192, kv_cache_memory_bytes=4 << 30,
        decode=DecodeGraphConfig(enabled=False), graph=GraphConfig("breakable"),
        prefill_schedule=args.schedule,
    )  # fmt: skip
    with torch.inference_mode():
        setup = set_up_rank(cfg)
    measure(f"rank set up ({args.schedule})", results)
    device = setup.device
    ctas = torch.cuda.get_device_properties(device).multi_processor_count
    if args.probes:
        import triton  # noqa: F401

        measure("triton imported", results)
        from service.ranks.attention import sm90_triton  # noqa: F401

        measure("sm90_triton imported", results)
        from service.ranks.attention.sm90_balance import rebalanced
        from service.ranks.attention.sm90_schedule import (
            device_plan_error,
            device_rewrite_error,
            probe_items,
        )

        items, indptr = probe_items(ctas)
        import numpy as np

        rebalanced(np.ones(len(items)), indptr)
        measure("host rewrite once", results)
        print("deal probe:", device_rewrite_error(device, ctas))
        measure("deal probe (device rewrite)", results)
        print("planner probe:", device_plan_error(device, ctas))
        measure("planner probe", results)
    gc.collect()
    measure("after gc.collect()", results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
