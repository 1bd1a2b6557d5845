"""The add-RMSNorm that sums a projection's split-K partials (service.model.splitk), one Triton
kernel (CUDA): per row, the S float32 partials summed and rounded to the input dtype (as the
GEMM's own output would have been), added to the residual stream (stored in place, or into a
new residual tensor), then RMSNorm'd into a new (T, N) tensor. One program per row; a row of N
float32 lives in registers.

Numerics: the sum over K runs in another order than cuBLAS's own, so the projection can differ
from ``F.linear``'s by the rounding of float32 partial sums; the norm is taken in float32 of the
unrounded residual sum, as FlashInfer's fused add-RMSNorm does. service.model.splitk.add_rms_norm
is the same arithmetic in torch.

Imported only where the rank chose it (service.ranks.select.choose_splitk_norm): it needs triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sum_add_rms_norm_kernel(
    parts_ptr,  # (S, T, N) float32 (or, S = 1, the projection itself), contiguous
    res_ptr,  # (T, N), row stride res_stride: read
    res_stride,
    new_ptr,  # (T, N), row stride new_stride: the residual with the sum added (may be res_ptr)
    new_stride,
    w_ptr,  # (N,) the norm's weight
    out_ptr,  # (T, N) contiguous: the normed rows
    T,
    N,
    eps,
    S: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(parts_ptr + (s * T + t) * N + cols, mask=mask, other=0.0).to(tl.float32)
    acc = acc.to(res_ptr.dtype.element_ty).to(tl.float32)
    x = acc + tl.load(res_ptr + t * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(new_ptr + t * new_stride + cols, x.to(new_ptr.dtype.element_ty), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    g = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * N + cols, (x * rstd * g).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    parts: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    new_residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """parts (S, T, N) float32 contiguous (or (1, T, N) in the residual's dtype: a projection
    not split), residual (T, N) with unit column stride -> (rms_norm(residual + sum),
    residual + sum); the sum is written into ``new_residual`` where given (same shape, unit
    column stride), else into the residual, in place."""
    s, t, n = parts.shape
    new = residual if new_residual is None else new_residual
    if new.shape != residual.shape or new.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError(
            f"the summing norm writes a ({t}, {n}) residual with unit column stride; got "
            f"{tuple(new.shape)} with strides {new.stride()} from {tuple(residual.shape)} "
            f"with strides {residual.stride()}"
        )
    out = torch.empty((t, n), dtype=residual.dtype, device=residual.device)
    if t:
        _sum_add_rms_norm_kernel[(t,)](
            parts, residual, residual.stride(0), new, new.stride(0), weight, out, t, n, eps,
            S=s, BLOCK=triton.next_power_of_2(n), num_warps=8,
        )  # fmt: skip
    return out, new
