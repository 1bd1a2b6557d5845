"""The model's linear layers alone: how close each GEMM shape runs to the copy bandwidth and the
matmul rate, and whether another kernel choice would be faster (GPU only).

For Qwen2.5-1.5B's shapes (qkv with bias, o_proj, gate_up, down) and token counts M, each
variant's time per call is measured inside one CUDA graph of 20 calls (no launch gaps), and the
per-layer sum is printed beside the weight-bytes floor. Variants:

- ``cublas``: ``F.linear`` as the model calls it (torch's default BLAS choice);
- ``cublaslt``: the same with torch's preferred BLAS library set to cuBLASLt;
- ``tunable``: torch's TunableOp, tuned for each shape first (whatever algorithms it offers);
- ``triton``: a split-K Triton kernel for few rows (prototype, fp32 atomics: not deterministic,
  so a measure of the headroom only), best of a small config sweep.

    python benchmarks/gemm_shapes.py --m 1,16,64,256,2048 --out gemm.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

H, I_, Q, KV = 1536, 8960, 1536, 256
SHAPES = {  # name: (N, K, bias)
    "qkv": (Q + 2 * KV, H, True),
    "o_proj": (H, Q, False),
    "gate_up": (2 * I_, H, False),
    "down": (H, I_, False),
}


def graph_us(fn, reps: int = 20, iters: int = 10) -> float:
    """Microseconds per call of ``fn``, replayed as one graph of ``reps`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(samples)


def save_rows(path: str | None, rows: list[dict]) -> None:
    """A probe's rows, with the device and torch they ran on, as JSON at ``path`` (if given)."""
    if path:
        saved = {"rows": rows, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
        Path(path).write_text(json.dumps(saved, indent=2))


def triton_linear():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(a, w, c, bias, M, N, K, sam, swn, scm,
               HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               SPLIT: tl.constexpr):  # fmt: skip
        pn, pm, pk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        per = K // SPLIT
        for k0 in range(pk * per, (pk + 1) * per, BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(a + rm[:, None] * sam + rk[None, :], mask=rm[:, None] < M, other=0.0)
            y = tl.load(w + rn[:, None] * swn + rk[None, :], mask=rn[:, None] < N, other=0.0)
            acc += tl.dot(x, tl.trans(y))
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if HAS_BIAS and pk == 0:
            acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        ptr = c + rm[:, None] * scm + rn[None, :]
        if SPLIT == 1:
            tl.store(ptr, acc.to(c.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(ptr, acc, mask=mask)

    def run(x, weight, bias, out, bm, bn, bk, split, warps, stages):
        m, k = x.shape
        n = weight.shape[0]
        grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
        if split > 1:
            out.zero_()
        kernel[grid](
            x, weight, out, bias if bias is not None else weight, m, n, k,
            x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
            BM=bm, BN=bn, BK=bk, SPLIT=split, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out

    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,16,64,128,256,1024,2048,8192")
    ap.add_argument("--triton-max-m", type=int, default=256)
    ap.add_argument("--variants", default="cublas,cublaslt,tunable,triton")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gemm_shapes.py measures CUDA kernels; no CUDA device here")
        return 0
    dev = torch.device("cuda")
    torch.manual_seed(0)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    # timed outside a graph: a captured 1 GiB copy measured 2.77 TB/s against 4.19 eagerly
    dst.copy_(src)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    copy_bw = 2 * (1 << 30) * 10 / (begin.elapsed_time(end) / 1e3)
    src = dst = None
    weights = {n: (torch.randn(nn, k, device=dev, dtype=torch.bfloat16) * 0.02,
                   torch.randn(nn, device=dev, dtype=torch.bfloat16) if bias else None)
               for n, (nn, k, bias) in SHAPES.items()}  # fmt: skip
    variants = args.variants.split(",")
    tri = triton_linear() if "triton" in variants else None
    results: list[dict] = []
    for m in [int(v) for v in args.m.split(",")]:
        for name, (n, k, _) in SHAPES.items():
            w, bias = weights[name]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, w, bias)
            floor_us = (w.numel() * 2 + x.numel() * 2 + m * n * 2) / copy_bw * 1e6
            row = {"m": m, "shape": name, "n": n, "k": k, "floor_us": floor_us}
            for v in variants:
                if v == "cublas":
                    row[v] = graph_us(lambda x=x, w=w, bias=bias: F.linear(x, w, bias))
                elif v == "cublaslt":
                    prev = torch.backends.cuda.preferred_blas_library()
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                    row[v] = graph_us(lambda x=x, w=w, bias=bias: F.linear(x, w, bias))
                    torch.backends.cuda.preferred_blas_library(prev)
                elif v == "tunable":
                    tun = torch.cuda.tunable
                    tun.enable(True)
                    if hasattr(tun, "write_file_on_exit"):  # absent from some torch versions
                        tun.write_file_on_exit(False)
                    tun.tuning_enable(True)
                    tun.set_max_tuning_duration(200)
                    for _ in range(2):  # tunes outside the graph
                        F.linear(x, w, bias)
                    torch.cuda.synchronize()
                    tun.tuning_enable(False)
                    row[v] = graph_us(lambda x=x, w=w, bias=bias: F.linear(x, w, bias))
                    tun.enable(False)
                elif v == "triton" and tri is not None and m <= args.triton_max_m:
                    best = None
                    bm = 16 if m <= 16 else 64  # two row tiles: few compiles on a lease
                    for bn, bk, split, warps, stages in itertools.product(
                        (32, 64, 128), (128, 256), (1, 2, 4, 8), (4,), (3,)
                    ):
                        if k % (bk * split):
                            continue
                        dtype = torch.bfloat16 if split == 1 else torch.float32
                        out = torch.empty(m, n, device=dev, dtype=dtype)

                        cfg = (bm, bn, bk, split, warps, stages)

                        def call(x=x, w=w, bias=bias, out=out, cfg=cfg):
                            return tri(x, w, bias, out, *cfg)

                        try:
                            got = call()
                            err = float((got.float() - ref.float()).abs().max())
                            us = graph_us(call, iters=5)
                        except Exception as exc:  # a config that does not compile or fit
                            print(f"triton {name} m={m} {cfg}: {exc!s:.80}")
                            continue
                        if best is None or us < best[0]:
                            best = (us, (bm, bn, bk, split, warps, stages), err)
                    if best:
                        row[v], row["triton_cfg"], row["triton_err"] = best
            results.append(row)
            cells = " ".join(f"{v} {row[v]:7.1f}" for v in variants if v in row)
            cfg_note = f" cfg {row['triton_cfg']}" if "triton_cfg" in row else ""
            print(f"m={m:>5} {name:>8} floor {floor_us:6.1f} us | {cells}{cfg_note}", flush=True)
    print(f"\nper layer (us; 4 GEMMs), copy {copy_bw / 1e12:.2f} TB/s")
    print(f"{'m':>6} {'floor':>7}" + "".join(f" {v:>9}" for v in variants))
    for m in sorted({r["m"] for r in results}):
        rs = [r for r in results if r["m"] == m]
        line = f"{m:>6} {sum(r['floor_us'] for r in rs):>7.1f}"
        for v in variants:
            line += (f" {sum(r[v] for r in rs):>9.1f}" if all(v in r for r in rs)
                     else f" {'-':>9}")  # fmt: skip
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_bytes_per_s": copy_bw, "rows": results,
                                              "torch": torch.__version__}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
