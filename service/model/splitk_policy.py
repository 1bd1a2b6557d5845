"""Into how many K-slices a row-parallel projection (o_proj, down) splits when its add-RMSNorm
sums the slices (a pure policy: no torch, no triton).

Why split at all: at a few hundred tokens these GEMMs have few output tiles for the H200's 132
SMs. cuBLAS then splits K itself and runs a second kernel to reduce the splits (down at 256
tokens: 15 + 3.8 us against 9 us of FLOPs), or leaves most SMs idle (o_proj). A batched GEMM
over S slices of K writes S float32 partials; the add-RMSNorm that reads the output anyway sums
them, so the reduce kernel goes and more SMs work.

The slices per shape, measured on the H200 (benchmarks/splitk_norm.py, docs/benchmarks.md,
session 36; microseconds for the projection + add-RMSNorm, cuBLAS + FlashInfer's norm against
the split):

- down (K = 8,960, N = 1,536): 4 slices at 16-256 rows (9.85 -> 9.09 at 16, 19.87 -> 15.81 at
  256), 2 at 512 (28.57 -> 24.16), none at 1,024 (42.5 against 45.5 with 2);
- o_proj (K = 1,536, N = 1,536): 2 slices at 16-256 rows (6.34 -> 5.42 at 16, 8.00 -> 7.18 at
  256), none at 512 (9.48 against 9.60).

Past 512 rows cuBLAS's tiles fill the GPU and the partials' extra traffic (S x rows x N x 4
bytes) costs more than the reduce kernel saved. Below 16 rows (decode batches of 1-15) nothing
was measured: there the projection reads its weight once whatever the tiling, cuBLAS runs a
GEMV-shaped kernel, and a batched GEMM of 1-15 rows per slice may not keep up with it, so those
stay cuBLAS's until measured.
"""

from __future__ import annotations

MIN_ROWS = 16  # the fewest rows measured faster split (decode batches below it keep cuBLAS)
MAX_ROWS = 512  # no split past this many rows (service.model.llama's MLP chunks are larger)
WIDE_K = 4096  # a reduction this long or longer (down) takes more slices than a short one
MAX_N = 16384  # the norm kernel holds one row of N float32 in registers


def slices(rows: int, k: int, n: int) -> int:
    """K-slices for a (rows, K) x (K, N) projection whose output feeds an add-RMSNorm; 1: do
    not split (cuBLAS's GEMM, then the norm)."""
    if rows < MIN_ROWS or rows > MAX_ROWS or n > MAX_N:
        return 1
    small = rows <= 256
    want = (4 if small else 2) if k >= WIDE_K else (2 if small else 1)
    while want > 1 and k % want:
        want //= 2
    return want
