"""A row-parallel projection split over K into float32 partials, summed later by the add-RMSNorm
that reads its output (service.model.splitk_policy says when and why; the summing kernel is
service.model.splitk_triton).

``partials(x, weight, s)``: x (T, K) times weight (N, K)^T as ``s`` products over K-slices, one
batched GEMM, -> (s, T, N) float32, without copying x or weight (slices are strided views).
``add_rms_norm(parts, residual, weight, eps, new_residual=None)``: the reference of the summing
kernel in plain torch (the arithmetic the kernel does, in the order it does it).
"""

from __future__ import annotations

import torch


def fits(x: torch.Tensor, weight: torch.Tensor, s: int) -> bool:
    """Whether :func:`partials` can view x (T, K) and weight (N, K) as ``s`` K-slices without a
    copy: unit column strides, a contiguous weight, K divisible by s."""
    k = x.shape[-1]
    return (
        x.dim() == 2
        and x.stride(1) == 1
        and weight.is_contiguous()
        and weight.shape[1] == k
        and k % s == 0
    )


def partials(x: torch.Tensor, weight: torch.Tensor, s: int) -> torch.Tensor:
    """x (T, K), weight (N, K) -> (s, T, N) float32: slice j is x[:, j*Kc:(j+1)*Kc] times
    weight[:, j*Kc:(j+1)*Kc]^T, Kc = K / s."""
    t, k = x.shape
    n, kc = weight.shape[0], k // s
    xs = x.as_strided((s, t, kc), (kc, x.stride(0), 1))  # (s, T, Kc)
    ws = weight.view(n, s, kc).permute(1, 2, 0)  # (s, Kc, N)
    if x.is_cuda:  # cuBLAS accumulates in float32 and writes the float32 partials directly
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())  # (bmm's out_dtype is CUDA-only)


def add_rms_norm(
    parts: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    new_residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """parts (S, T, N) float32 (or (1, T, N) in the residual's dtype: a projection not split),
    residual (T, N) -> (rms_norm(residual + sum), residual + sum), the sum written into
    ``new_residual`` where given, else into the residual in place: the sum rounded to the
    residual's dtype (as the projection's own output would have been), added in float32, the
    norm taken of the unrounded float32 sum and scaled by ``weight`` in float32."""
    proj = parts.float().sum(0).to(residual.dtype).float()
    x = proj + residual.float()
    new = residual if new_residual is None else new_residual
    new.copy_(x)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(residual.dtype), new
