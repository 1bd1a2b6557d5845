"""Probe: the o_proj and down GEMMs split over K into fp32 partials, summed by the add-RMSNorm that
reads them, against cuBLAS's GEMM then FlashInfer's add-RMSNorm (GPU only).

Why: at 256 tokens a layer's down GEMM (M=256, N=1536, K=8960) has 24 output tiles for 132 SMs,
so cuBLAS splits K and runs a second kernel to reduce the splits (15 us + 3.8 us, against 9 us of
FLOPs at the burst rate); o_proj (K=1536) runs 24 tiles without splitting (6.1 us against 1.5).
Both outputs go straight into an add-RMSNorm. If a batched GEMM over K-slices writes the fp32
partials and the norm kernel sums them while adding the residual, the reduce kernel goes and
more SMs work. This measures whether that wins, per token count, before the model uses it.

Variants, microseconds per call inside one CUDA graph of 20 calls (``gemm_shapes.graph_us``):

- ``ref``: ``F.linear`` then FlashInfer's ``fused_add_rmsnorm`` (what the model runs);
- ``ref_gemm``: ``F.linear`` alone;
- ``bmm{S}``: ``torch.bmm`` over S K-slices with fp32 output, alone (service.model.splitk);
- ``new{S}``: that, then one Triton kernel (service.model.splitk_triton, as the model runs it):
  the S partials summed (rounded to bf16, as the GEMM's output was), the residual added and
  stored, the RMSNorm written;
- ``op``: what ``tc_piecewise``'s compiled pieces run since session 46, the op
  (service.model.splitk_op) that splits as the policy says at these rows, or runs ``F.linear``
  and the same Triton kernel with one partial where it does not split;
- ``ind``: what they ran before it, ``F.linear`` then the torch add-RMSNorm compiled by
  inductor (dynamic shapes, as the pieces are compiled): cuBLAS, then inductor's fused norm.

    python benchmarks/splitk_norm.py --m 16,64,256,1024 --out splitk.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gemm_shapes import graph_us, save_rows
from service.model import splitk, splitk_op
from service.model.kernels import Kernels

H, I_ = 1536, 8960
SHAPES = {"o_proj": (H, H), "down": (H, I_)}  # name: (N, K)


def _compiled_add_norm(
    x: torch.Tensor, w: torch.Tensor, res: torch.Tensor, g: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The projection, then the reference add-RMSNorm: under torch.compile, what a piece ran
    before the op (cuBLAS's GEMM, inductor's fused add and norm)."""
    return Kernels()._add_rms_norm(F.linear(x, w), res, g, eps)


def measure(name: str, n: int, k: int, m: int, splits: list[int], norm, fi, compiled) -> dict:
    """One shape at ``m`` rows: the reference and each split's variants (us), and how far each
    split's results are from the reference's (relative to their largest value)."""
    dt, dev, eps = torch.bfloat16, "cuda", 1e-6
    w = torch.randn(n, k, device=dev, dtype=dt) / k**0.5
    g = torch.rand(n, device=dev, dtype=dt) + 0.5
    x = torch.randn(m, k, device=dev, dtype=dt)
    res0 = torch.randn(m, n, device=dev, dtype=dt)
    res = res0.clone()  # the timed calls add into it: its values drift, its cost does not
    row: dict = {"shape": name, "m": m}

    def ref() -> None:
        fi.norm.fused_add_rmsnorm(F.linear(x, w), res, g, eps)

    row["ref"] = graph_us(ref)
    row["ref_gemm"] = graph_us(lambda: F.linear(x, w))
    want_res, want = res0.clone(), F.linear(x, w)
    fi.norm.fused_add_rmsnorm(want, want_res, g, eps)
    for s in splits:
        if k % s:
            continue

        def bmm(s: int = s) -> torch.Tensor:  # (S, M, N) fp32: the model's call
            return splitk.partials(x, w, s)

        def new(bmm=bmm) -> None:
            norm(bmm(), res, g, eps)

        row[f"bmm{s}"] = graph_us(bmm)
        row[f"new{s}"] = graph_us(new)
        got_res = res0.clone()
        out, _ = norm(bmm(), got_res, g, eps)
        torch.cuda.synchronize()
        d_out = float((out - want).abs().max()) / float(want.abs().max())
        d_res = float((got_res - want_res).abs().max()) / float(want_res.abs().max())
        row[f"maxdiff{s}"] = max(d_out, d_res)
    new_res = torch.empty_like(res)
    row["op"] = graph_us(lambda: splitk_op.row_linear_add_rms_norm(x, w, res, g, eps, new_res))
    row["ind"] = graph_us(lambda: compiled(x, w, res, g, eps))
    out = splitk_op.row_linear_add_rms_norm(x, w, res0, g, eps, new_res)
    torch.cuda.synchronize()
    row["maxdiff_op"] = max(
        float((out - want).abs().max()) / float(want.abs().max()),
        float((new_res - want_res).abs().max()) / float(want_res.abs().max()),
    )
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="16,64,128,256,512,1024,2048")
    ap.add_argument("--splits", default="2,4,5,7")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import flashinfer

    from service.model.splitk_triton import add_rms_norm as norm  # the model's kernel

    torch.manual_seed(0)
    splits = [int(v) for v in args.splits.split(",")]
    results: list[dict] = []
    head = "".join(f" {'bmm' + str(s):>7} {'new' + str(s):>7}" for s in splits)
    print(f"{'shape':>7} {'M':>5} {'ref':>7} {'gemm':>7}{head} {'op':>7} {'ind':>7}  maxdiff")
    for name, (n, k) in SHAPES.items():
        compiled = torch.compile(_compiled_add_norm, dynamic=True)  # one compile per shape
        for m in [int(x) for x in args.m.split(",")]:
            row = measure(name, n, k, m, splits, norm, flashinfer, compiled)
            results.append(row)
            nan = float("nan")
            cells = "".join(f" {row.get(f'bmm{s}', nan):>7.2f} {row.get(f'new{s}', nan):>7.2f}"
                            for s in splits)  # fmt: skip
            diffs = [row[f"maxdiff{s}"] for s in splits if f"maxdiff{s}" in row]
            diff = max([*diffs, row["maxdiff_op"]])
            print(f"{name:>7} {m:>5} {row['ref']:>7.2f} {row['ref_gemm']:>7.2f}{cells} "
                  f"{row['op']:>7.2f} {row['ind']:>7.2f}  {diff:.1e}", flush=True)  # fmt: skip
    save_rows(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
