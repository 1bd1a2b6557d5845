"""FlashInfer's two ragged-prefill kernels side by side: FA2 against FA3 (Hopper), per bucket.

Why: every prefill layer makes one attention call; at small buckets it is latency, not FLOPs
(8-9 us per layer at 256 tokens for FA3 on the H200, against a quarter of a microsecond of
arithmetic), 28 times a forward. This measures, for the benchmark model's heads, the device time
of one call of each kernel (inside a CUDA graph of ``--calls`` calls, so no launch gaps) and the
host time of each kernel's plan, on the layouts the capture service builds (one request up to
the context length, then requests of the context length).

    python benchmarks/attention_kernels.py --buckets 16,64,256,1024,2048,4096,8192
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


def measure(
    w: Any,
    qo: torch.Tensor,
    qkv: tuple[torch.Tensor, ...],
    heads: tuple[int, int, int],
    args: argparse.Namespace,
) -> tuple[float, float, torch.Tensor]:
    """One wrapper's device us per call, host us per plan, and its output."""
    hq, hkv, d = heads
    q, k, v = qkv
    out = torch.empty_like(q)

    def plan() -> None:
        w.plan(
            qo, qo, hq, hkv, d, causal=True,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
        )  # fmt: skip

    plan()
    dev_us = graph_us(lambda: w.run(q, k, v, out=out), args.calls, args.repeats)
    plan_us = host_ms(plan, args.repeats) * 1e3
    plan()
    w.run(q, k, v, out=out)
    return dev_us, plan_us, out.float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", default="16,64,256,1024,2048,4096,8192")
    ap.add_argument("--context-length", type=int, default=2048)
    ap.add_argument("--heads", default="12,2,128", help="query heads, KV heads, head dim")
    ap.add_argument("--kernels", default="fa2,fa3")
    ap.add_argument("--calls", type=int, default=28, help="calls per graph (the model's layers)")
    ap.add_argument("--repeats", type=int, default=20)
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
    for bucket in (int(b) for b in args.buckets.split(",")):
        lengths = partition_bucket(bucket, args.context_length)
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
        if len(outs) == 2:
            a, b = outs.values()
            row["max_abs_diff"] = (a - b).abs().max().item()
        rows.append(row)
        cells = " ".join(f"{row[k + '_us']:>9.2f} {row[k + '_plan_us']:>9.1f}" for k in kernels)
        diff = f"  max diff {row['max_abs_diff']:.4f}" if "max_abs_diff" in row else ""
        print(f"{bucket:>6} {len(lengths):>4} {cells}{diff}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "rows": rows, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "flashinfer": flashinfer.__version__, "args": vars(args),
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
