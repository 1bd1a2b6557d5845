"""Probe: what the device loses at each hand-over between a replayed CUDA graph and a kernel
launched on its own, the shape of a segment backend's forward (GPU only).

A ``breakable`` forward at 256 tokens is 29 graph replays with 28 attention launches between
them; its profiled timelines (docs/benchmarks.md, sessions 37 and 48) show about 4 us of idle
device at each of the 56 hand-overs, against well under 1 us between two kernels inside one
graph. This measures that gap apart from attention and the model, with stand-ins of the same
shape: a "segment" of six small kernels (four GEMMs of 256 x 1536 x 1536 and two adds) and a
"call" of one kernel, 28 times:

- ``one_graph``: all of it captured as one graph (the floor: no hand-over);
- ``graph_kernel``: each segment a graph replay, each call launched eagerly (the segment
  backends today);
- ``graph_graph``: the call captured as its own one-kernel graph too;
- ``eager``: everything launched eagerly.

Each variant is timed with CUDA events, once from an idle device and once queued behind about
2 ms of device work, so that the host has launched everything before the device gets there
and only the device's own gaps remain. ``gap_us``: (variant - one_graph) / 56.

    python benchmarks/handover_gap.py --out handover_gap.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gemm_shapes import save_rows
from benchmarks.graph_launch import capture

LAYERS = 28


def timed(fn: Callable[[], None], behind: Callable[[], None] | None, iters: int) -> float:
    """Median us of ``fn`` by CUDA events; ``behind``: queued first, outside the events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        if behind is not None:
            behind()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        samples.append(a.elapsed_time(b) * 1e3)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    t, h = args.tokens, 1536
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(h, h, device=dev, dtype=torch.bfloat16) * h**-0.5 for _ in range(4)]
    y = torch.empty_like(x)
    z = torch.empty_like(x)
    wc = torch.randn(h, h, device=dev, dtype=torch.bfloat16) * h**-0.5
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def segment() -> None:
        torch.mm(x, ws[0], out=y)
        y.add_(x)
        torch.mm(y, ws[1], out=z)
        torch.mm(z, ws[2], out=y)
        y.add_(z)
        torch.mm(y, ws[3], out=z)

    def call() -> None:  # the attention stand-in: one kernel
        torch.mm(z, wc, out=x)

    def whole() -> None:
        for _ in range(LAYERS):
            segment()
            call()

    seg_g, call_g, whole_g = capture(segment), capture(call), capture(whole)

    def graph_kernel() -> None:
        for _ in range(LAYERS):
            seg_g.replay()
            call()

    def graph_graph() -> None:
        for _ in range(LAYERS):
            seg_g.replay()
            call_g.replay()

    def busy() -> None:  # about 2 ms on an H100 / H200
        for _ in range(2):
            torch.mm(big, big)

    variants = {"one_graph": whole_g.replay, "graph_kernel": graph_kernel,
                "graph_graph": graph_graph, "eager": whole}  # fmt: skip
    rows = []
    print(f"{'variant':>13} {'idle us':>9} {'behind us':>10} {'gap idle':>9} {'gap behind':>11}")
    base: dict[str, float] = {}
    for name, fn in variants.items():
        idle = timed(fn, None, args.iters)
        behind = timed(fn, busy, args.iters)
        if name == "one_graph":
            base = {"idle": idle, "behind": behind}
        row = {"variant": name, "idle_us": round(idle, 1), "behind_us": round(behind, 1),
               "gap_idle_us": round((idle - base["idle"]) / (2 * LAYERS), 2),
               "gap_behind_us": round((behind - base["behind"]) / (2 * LAYERS), 2)}  # fmt: skip
        rows.append(row)
        print(f"{name:>13} {idle:>9.1f} {behind:>10.1f} {row['gap_idle_us']:>9.2f} "
              f"{row['gap_behind_us']:>11.2f}", flush=True)  # fmt: skip
    save_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
