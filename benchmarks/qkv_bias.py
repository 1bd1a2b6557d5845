"""Probe: the qkv projection's bias in the GEMM (cuBLAS's bias epilogue, what the model runs)
against the GEMM without it and the bias added by the rotary + K/V store kernel that reads the
projection next (service.model.rope_store_triton, ``bias=``) (GPU only).

Why: at 256 tokens the profile of a prefill (docs/benchmarks.md, session 50) has cuBLAS run
qkv's (256, 1536) x (1536, 2048) GEMM with its bias epilogue as 64 x 64 tiles, 6.5 us a layer
against 2.1 us of FLOPs at the burst rate; without the epilogue cuBLAS may pick another kernel.
The rotary kernel loads every element of q, k and v anyway, so the bias costs it one more load
of a 2,048-wide row per program.

Variants, microseconds per call inside one CUDA graph of 20 calls (``gemm_shapes.graph_us``):
``addmm`` / ``mm`` (the GEMM with / without the bias), ``rope`` / ``rope_bias`` (the kernel
without / with it), ``now`` (addmm then rope: the model today) and ``fused`` (mm then
rope_bias). The outputs of ``now`` and ``fused`` are compared (rotated q and k, v, the cache).

    python benchmarks/qkv_bias.py --m 16,64,256,1024,2048 --out qkv_bias.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gemm_shapes import graph_us, save_rows

H, HQ, HKV, D = 1536, 12, 2, 128


def measure(m: int) -> dict:
    from service.model import rope_store_triton as rs

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(m)
    n = (HQ + 2 * HKV) * D
    x = torch.randn(m, H, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, H, device=dev, generator=g) * H**-0.5).to(torch.bfloat16)
    b = torch.randn(n, device=dev, generator=g).to(torch.bfloat16)
    pos = torch.arange(m, device=dev) % 4096
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
    ang = torch.arange(4096, device=dev).float()[:, None] * inv[None, :]
    table = torch.cat([ang.cos(), ang.sin()], dim=-1).contiguous()  # (P, D) float32
    loc = torch.arange(1, m + 1, device=dev)
    kv_a = torch.zeros(m + 1, 2, HKV, D, device=dev, dtype=torch.bfloat16)
    kv_b = torch.zeros_like(kv_a)
    qkv_a = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    qkv_b = torch.empty_like(qkv_a)
    wt = w.t()

    def addmm() -> None:
        torch.addmm(b, x, wt, out=qkv_a)

    def mm() -> None:
        torch.mm(x, wt, out=qkv_b)

    def rope() -> None:
        rs.rope_store(qkv_a, (HQ, HKV), D, pos, table, kv_a, loc)

    def rope_bias() -> None:
        rs.rope_store(qkv_b, (HQ, HKV), D, pos, table, kv_b, loc, bias=b)

    def now() -> None:
        addmm()
        rope()

    def fused() -> None:
        mm()
        rope_bias()

    row = {"m": m}
    for name, fn in (("addmm", addmm), ("mm", mm), ("now", now), ("fused", fused)):
        row[name] = round(graph_us(fn), 2)
    # the kernels alone (rotating in place again and again: the values drift, the work not)
    row["rope"] = round(graph_us(rope), 2)
    row["rope_bias"] = round(graph_us(rope_bias), 2)
    now()
    fused()
    torch.cuda.synchronize()
    row["max_diff_qkv"] = float((qkv_a.float() - qkv_b.float()).abs().max())
    row["max_diff_cache"] = float((kv_a.float() - kv_b.float()).abs().max())
    row["max_abs"] = float(qkv_a.float().abs().max())
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,4,16,64,128,256,512,1024,2048,8192")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    print(f"{'m':>6} {'addmm':>7} {'mm':>7} {'rope':>7} {'rope_b':>7} {'now':>7} {'fused':>7} "
          f"{'fused/now':>9} {'diff':>8}")  # fmt: skip
    for m in (int(v) for v in args.m.split(",")):
        r = measure(m)
        rows.append(r)
        print(f"{m:>6} {r['addmm']:>7.2f} {r['mm']:>7.2f} {r['rope']:>7.2f} {r['rope_bias']:>7.2f} "
              f"{r['now']:>7.2f} {r['fused']:>7.2f} {r['fused'] / r['now']:>9.3f} "
              f"{max(r['max_diff_qkv'], r['max_diff_cache']):>8.4f}", flush=True)  # fmt: skip
    save_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
