"""What a CUDA graph launch costs on the host, and when the device starts it, against node count.

A prefill replay of ``full`` was one graph of about 320-350 kernel nodes; at small buckets the
device waited for the host's work before it (the attention plan, the input copies) and for the
launch itself (``full`` now launches a chain of graphs, the first of one layer). This probe
separates the launch: graphs of N tiny elementwise kernels (about 2 us of device time each), and
of N small GEMMs (cuBLAS, launched with extended attributes, as the model's linear layers are),
timed on the host and placed on the profiler's clock; and the same N kernels as two graphs, a
short one launched first so the device starts while the host launches the rest.

    python benchmarks/graph_launch.py --out graph_launch.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timeline import HEADER, host_ms, row, timed, timeline


def capture(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()  # warm-up: cuBLAS picks and loads its kernels outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    torch.cuda.synchronize()
    return g


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="32,128,345,1024")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    x = torch.zeros(1024, device="cuda")
    a = torch.randn(16, 1536, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 1536, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(16, 1536, device="cuda", dtype=torch.bfloat16)

    def adds(n: int) -> Callable[[], None]:
        def body() -> None:
            for _ in range(n):
                x.add_(1)

        return body

    def gemms(n: int) -> Callable[[], None]:
        def body() -> None:
            for _ in range(n):
                torch.mm(a, w.t(), out=out)

        return body

    results = []
    print(f"{'graph':>22} {'host us':>8} {'event us':>9}  {HEADER}")
    for n in [int(v) for v in args.nodes.split(",")]:
        cases: dict[str, Callable[[], None]] = {}
        g = capture(adds(n))
        cases[f"{n} adds"] = g.replay
        head, rest = capture(adds(12)), capture(adds(n - 12))

        def split(head=head, rest=rest) -> None:  # the device starts on 12 while the rest launches
            head.replay()
            rest.replay()

        cases[f"{n} adds as 12 + {n - 12}"] = split
        if n <= 345:
            cases[f"{n} gemms"] = capture(gemms(n)).replay
        for name, fn in cases.items():
            fn()
            t = timeline(fn)
            r = {
                "graph": name,
                "host_us": host_ms(fn, 50) * 1e3,
                "event_us": timed(fn, x.device, 50) * 1e3,
                **t.to_json(),
            }
            results.append(r)
            print(f"{name:>22} {r['host_us']:>8.0f} {r['event_us']:>9.0f}  {row(t)}", flush=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "rows": results,
                    "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
