"""A row-parallel projection and the add-RMSNorm after it as one opaque op, for compiled
``tc_piecewise`` pieces, which choose the split over K at run time.

Why an op: outside ``torch.compile`` :meth:`service.model.kernels.Kernels.row_linear` asks
service.model.splitk_policy how many K-slices the projection takes at this call's rows, and the
summing norm (service.model.splitk_triton) adds the float32 partials. In a piece, traced once
with a symbolic token count for every bucket, that test would be a guard on the token count: a
retrace per slice count. Without it inductor runs cuBLAS's GEMM, which at a few hundred rows
splits K itself and runs its own reduce kernel (down at 256 tokens on the H200: 15.07 + 3.54 us
against the split's 13.39; o_proj 6.25 against 5.62; docs/benchmarks.md, session 45). Inside
this op the token count is a plain int again, so the policy decides per call, and per bucket in
a captured graph, with one trace. Measured on the H200 (session 46): at 256 tokens a forward
runs 28 kernels fewer and 0.14 ms less device time, 2.78-2.97x the floor against 3.03-3.18.

``row_linear_add_rms_norm(x, weight, residual, norm_weight, eps, new_residual) -> normed``:
x (T, K), weight (N, K), residual (T, N); writes residual + x W^T into ``new_residual``
(T, N), a tensor the caller made for it, and returns rms_norm of that sum times
``norm_weight``. Split, the sum is the slices' float32 partials summed; not split, the
projection's own output; both rounded to the residual's dtype before the add, as the
projection's output would be.

The residual is a declared write into a given tensor, not a second output: where the new
residual is what the piece hands to the next one, service.ranks.runners.tc_piecewise.handover
gives the op the hand-over buffer itself (service.model.out_twins.register_filled), so no copy
follows. The input residual is left as it is: it may be the previous piece's hand-over buffer,
which a declared mutation would make the compiler copy first.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from service.model import out_twins, splitk
from service.model.splitk_policy import slices

OP_NAME = "capture_service::row_linear_add_rms_norm"


def _sum_add_rms_norm(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    new_residual: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    if parts.is_cuda:
        from service.model import splitk_triton  # needs triton: only where CUDA runs the op

        return splitk_triton.add_rms_norm(parts, residual, weight, eps, new_residual)[0]
    return splitk.add_rms_norm(parts, residual, weight, eps, new_residual)[0]


@torch.library.custom_op(OP_NAME, mutates_args=("new_residual",))
def row_linear_add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    new_residual: torch.Tensor,
) -> torch.Tensor:
    s = slices(x.shape[0], x.shape[-1], weight.shape[0])
    if s > 1 and splitk.fits(x, weight, s):
        parts = splitk.partials(x, weight, s)  # (S, T, N) float32
    else:
        parts = F.linear(x, weight).unsqueeze(0)  # (1, T, N), the residual's dtype
    return _sum_add_rms_norm(parts, residual, norm_weight, eps, new_residual)


@row_linear_add_rms_norm.register_fake
def _(x, weight, residual, norm_weight, eps, new_residual):
    return residual.new_empty(residual.shape)


# new_residual (argument 5) is written whole: a piece may pass its hand-over buffer there
out_twins.register_filled(torch.ops.capture_service.row_linear_add_rms_norm, 5, "new_residual")
