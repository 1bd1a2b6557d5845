"""Probe: the residual add moved into the o_proj / down GEMM's epilogue (cuBLAS's beta = 1), then
a plain RMSNorm, against the GEMM then FlashInfer's fused add-RMSNorm (what the model runs past
512 rows; GPU only).

Why: at 2,048 tokens the fused add-RMSNorm runs 56 times a forward at about 8.3 us, which is its
traffic at the copy rate: it reads the GEMM's output and the residual and writes both back (4 x
rows x 1,536 x 2 bytes, 25 MB). With the add in the GEMM (``residual.addmm_(x, w.t())``: cuBLAS
reads the residual as C and writes the sum in place) the norm reads one tensor and writes one,
half the traffic, while the GEMM reads C once in its epilogue. Whether that wins depends on what
the epilogue's read costs the GEMM and on the kernel cuBLAS picks with beta = 1; this measures it
per token count before the model changes.

Variants, microseconds per call inside one CUDA graph of 20 calls (``gemm_shapes.graph_us``):

- ``ref``: ``F.linear`` then FlashInfer's ``fused_add_rmsnorm`` (the model's path);
- ``gemm``: ``F.linear`` alone;
- ``addmm``: ``residual.addmm_(x, w.t())`` alone;
- ``new``: that, then FlashInfer's ``rmsnorm`` into a preallocated output;
- ``norm``: FlashInfer's ``rmsnorm`` alone.

``maxdiff``: the largest difference between ``new``'s normed output and residual and the
reference's, relative to the reference's largest value (one rounding fewer: the sum is rounded to
bf16 once, not the GEMM's output first).

    python benchmarks/residual_gemm.py --m 512,1024,2048,4096,8192 --out residual_gemm.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gemm_shapes import graph_us, save_rows

H, I_ = 1536, 8960
SHAPES = {"o_proj": (H, H), "down": (H, I_)}  # name: (N, K)


def measure(name: str, n: int, k: int, m: int, fi) -> dict:
    dt, dev, eps = torch.bfloat16, "cuda", 1e-6
    w = torch.randn(n, k, device=dev, dtype=dt) / k**0.5  # (N, K), as nn.Linear holds it
    g = torch.rand(n, device=dev, dtype=dt) + 0.5
    x = torch.randn(m, k, device=dev, dtype=dt)
    res0 = torch.randn(m, n, device=dev, dtype=dt)
    res = res0.clone()  # the timed calls add into it: its values drift, its cost does not
    out = torch.empty(m, n, device=dev, dtype=dt)
    wt = w.t()

    def ref() -> None:
        fi.norm.fused_add_rmsnorm(F.linear(x, w), res, g, eps)

    def addmm() -> None:
        res.addmm_(x, wt)

    def new() -> None:
        res.addmm_(x, wt)
        fi.norm.rmsnorm(res, g, eps, out=out)

    row: dict = {"shape": name, "m": m}
    row["ref"] = graph_us(ref)
    row["gemm"] = graph_us(lambda: F.linear(x, w))
    row["addmm"] = graph_us(addmm)
    row["new"] = graph_us(new)
    row["norm"] = graph_us(lambda: fi.norm.rmsnorm(res, g, eps, out=out))
    want, want_res = F.linear(x, w), res0.clone()
    fi.norm.fused_add_rmsnorm(want, want_res, g, eps)
    got_res = res0.clone()
    got_res.addmm_(x, wt)
    got = fi.norm.rmsnorm(got_res, g, eps)
    torch.cuda.synchronize()
    d_out = float((got - want).abs().max()) / float(want.abs().max())
    d_res = float((got_res - want_res).abs().max()) / float(want_res.abs().max())
    row["maxdiff"] = max(d_out, d_res)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="512,1024,2048,4096,8192")
    ap.add_argument("--rounds", type=int, default=1, help="every size this many times, in turn")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import flashinfer

    torch.manual_seed(0)
    results: list[dict] = []
    print(f"{'shape':>7} {'M':>5} {'ref':>7} {'gemm':>7} {'addmm':>7} {'new':>7} {'norm':>7} "
          f"{'new/ref':>7}  maxdiff")  # fmt: skip
    for _ in range(args.rounds):
        for name, (n, k) in SHAPES.items():
            for m in [int(v) for v in args.m.split(",")]:
                r = measure(name, n, k, m, flashinfer)
                results.append(r)
                print(f"{name:>7} {m:>5} {r['ref']:>7.2f} {r['gemm']:>7.2f} {r['addmm']:>7.2f} "
                      f"{r['new']:>7.2f} {r['norm']:>7.2f} {r['new'] / r['ref']:>7.3f}  "
                      f"{r['maxdiff']:.1e}", flush=True)  # fmt: skip
    save_rows(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
