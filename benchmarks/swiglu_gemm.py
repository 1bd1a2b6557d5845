"""gate_up GEMM and SiLU-and-mul in one Triton kernel, against cuBLAS plus FlashInfer's
SiLU-and-mul (GPU only; prototype measurement).

Why: at 2,048 tokens SiLU-and-mul takes 0.75 ms of a 10.8-ms forward (docs/benchmarks.md,
session 28): it reads the gate_up GEMM's (T, 2I) output and writes (T, I), bytes the floor does
not count. Computing silu(gate) * up on the GEMM's accumulators writes (T, I) once and never
reads it back. This script measures whether a Triton GEMM with that epilogue keeps up with cuBLAS
on Qwen2.5-1.5B's gate_up shape (K = 1536, 2I = 17920), per token count and config.

Variants (device us per call inside one CUDA graph of 20 calls, ``gemm_shapes.graph_us``):

- ``ref``: ``F.linear`` then FlashInfer's ``silu_and_mul`` (torch's where FlashInfer is absent),
  what the model runs today; ``gemm`` is its GEMM alone;
- ``ptr``: the fused kernel with pointer loads (Triton pipelines them itself);
- ``tma``: the service's kernel (host-built tensor descriptors: TMA loads and store; one
  (2 BN)-wide dot per step through a (2, N, K) view of the weight);
- ``tma2``: the same with two BN-wide dots per step (the service's kernel until session 40);
- ``tmap``: the same, persistent (one program per SM walks the tiles);
- ``tmaws``: persistent with Triton's warp specialization;
- ``tma1``: one (2 BN)-wide dot per step on a reordered weight (gate and up blocks interleaved).

With ``--host``, also the host time of one call as the service makes it
(``service.model.gate_up_triton.gate_up_silu``, kernel or pair by the token count) and of the pair
alone: 200 calls queued back to back, no synchronisation inside, wall time per call. That is what
an eager forward pays per layer where the host, not the device, sets the pace.

    python benchmarks/swiglu_gemm.py --m 16,256,1024,2048,8192 --out swiglu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gemm_shapes import graph_us

H, I_ = 1536, 8960

# (BM, BN, BK, stages, warps, group_m): BN is per half, so a tile computes 2 * BN GEMM columns
CONFIGS = [
    (128, 128, 64, 3, 8, 4),
    (128, 128, 64, 3, 8, 8),
    (128, 128, 64, 3, 8, 16),
    (128, 128, 64, 4, 8, 8),
    (128, 128, 32, 5, 8, 8),
    (128, 128, 32, 6, 8, 8),
    (128, 64, 64, 4, 4, 8),
    # the same 32K float32 accumulators in other shapes (not yet swept on a GPU): at 2,048 rows
    # the kernel ran at 1.2x its FLOPs at the burst rate where cuBLAS's GEMMs ran at 1.0x
    # (docs/benchmarks.md, session 37)
    (256, 64, 64, 4, 8, 8),
    (64, 256, 64, 3, 8, 8),
]
SMALL = [(16, 64, 128, 3, 4, 1), (16, 128, 128, 3, 4, 1), (16, 64, 64, 4, 4, 1),
         (16, 32, 128, 4, 4, 1), (32, 64, 128, 3, 4, 1), (64, 128, 64, 4, 4, 1),
         (64, 64, 64, 4, 4, 1), (64, 128, 64, 4, 4, 8)]  # fmt: skip


def kernels():
    import triton

    from benchmarks.swiglu_kernels import (
        make_tma,
        make_tma_one,
        make_tma_persistent,
        make_tma_two,
        run_ptr,
    )

    return triton, run_ptr, make_tma, make_tma_persistent, make_tma_one, make_tma_two


def host_us(fn, calls: int = 200) -> float:
    """Wall us per call of ``calls`` calls queued without synchronising (median of 5)."""
    import statistics
    import time

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="16,256,1024,2048,4096,8192")
    ap.add_argument("--variants", default="tma,tmap,tmaws")
    ap.add_argument("--host", action="store_true", help="host us per call, service vs pair")
    ap.add_argument("--configs", default=None,
                    help="the configs to sweep instead of the built-in lists, as "
                         "'BM,BN,BK,stages,warps,group;...'")  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("swiglu_gemm.py measures CUDA kernels; no CUDA device here")
        return 0
    try:
        import flashinfer

        def silu_mul(t: torch.Tensor) -> torch.Tensor:
            return flashinfer.activation.silu_and_mul(t)
    except ImportError:

        def silu_mul(t: torch.Tensor) -> torch.Tensor:
            g, u = t.chunk(2, dim=-1)
            return F.silu(g) * u

    triton, run_ptr, make_tma, make_tmap, make_tma1, make_tma2 = kernels()
    print("torch", torch.__version__, "triton", triton.__version__, flush=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w = torch.randn(2 * I_, H, device=dev, dtype=torch.bfloat16) * 0.02
    variants = args.variants.split(",")
    chosen = None
    if args.configs:
        chosen = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c]
        if any(len(c) != 6 for c in chosen):
            ap.error("--configs takes six integers per config: BM,BN,BK,stages,warps,group")
    rows = []
    for m in [int(v) for v in args.m.split(",")]:
        x = torch.randn(m, H, device=dev, dtype=torch.bfloat16)
        ref = silu_mul(F.linear(x, w))
        scale = float(ref.float().abs().max())
        row: dict = {"m": m, "gemm": graph_us(lambda x=x: F.linear(x, w)),
                     "ref": graph_us(lambda x=x: silu_mul(F.linear(x, w)))}  # fmt: skip
        flops = 2 * m * H * 2 * I_
        for v in variants:
            best = None
            listed = (SMALL if m <= 256 else []) + (CONFIGS if m >= 128 else [])
            for cfg in chosen or listed:
                out = torch.empty(m, I_, device=dev, dtype=torch.bfloat16)
                try:
                    if v == "ptr":
                        call = lambda x=x, out=out, cfg=cfg: run_ptr(x, w, out, *cfg)  # noqa: E731
                    elif v == "tma":
                        call = make_tma(x, w, out, *cfg)
                    elif v == "tma1":
                        call = make_tma1(x, w, out, *cfg)
                    elif v == "tma2":
                        call = make_tma2(x, w, out, *cfg)
                    else:
                        call = make_tmap(x, w, out, *cfg, ws=v == "tmaws")
                    got = call()
                    torch.cuda.synchronize()
                    err = float((got.float() - ref.float()).abs().max()) / scale
                    us = graph_us(call, iters=5)
                except Exception as exc:  # a config that does not compile or fit
                    print(f"  {v} m={m} {cfg}: {type(exc).__name__}: {exc!s:.100}", flush=True)
                    continue
                print(f"  {v} m={m} {cfg}: {us:8.2f} us, rel err {err:.2e}", flush=True)
                if best is None or us < best[0]:
                    best = (us, cfg, err)
            if best:
                row[v], row[f"{v}_cfg"], row[f"{v}_err"] = best
        if args.host:
            from service.model.gate_up_triton import gate_up_silu

            row["host_service"] = host_us(lambda x=x: gate_up_silu(x, w, True))
            row["host_pair"] = host_us(lambda x=x: silu_mul(F.linear(x, w)))
        rows.append(row)
        cells = " ".join(f"{v} {row[v]:8.2f}" for v in ["gemm", "ref", *variants] if v in row)
        print(f"m={m:>5} {cells}  (ref {flops / row['ref'] / 1e6:.0f} TFLOP/s)", flush=True)
    print(f"\n{'m':>6} {'gemm':>8} {'ref':>8}" + "".join(f" {v:>8} {'/ref':>5}" for v in variants))
    if args.host:
        for r in rows:
            print(f"host us per call, m={r['m']}: service {r['host_service']:.1f}, "
                  f"pair {r['host_pair']:.1f}")  # fmt: skip
    for r in rows:
        line = f"{r['m']:>6} {r['gemm']:>8.2f} {r['ref']:>8.2f}"
        for v in variants:
            line += f" {r[v]:>8.2f} {r[v] / r['ref']:>5.2f}" if v in r else f" {'-':>8} {'-':>5}"
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "torch": torch.__version__,
                                              "triton": triton.__version__}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
