"""One GEMM per expert group in a single call, as an opaque op: ``grouped_mm(a, b, offs)``.

Rows of ``a`` (M, K) come sorted by group; group g owns rows [offs[g-1], offs[g]) and multiplies
them by ``b[g]`` (K, N). ``torch._grouped_mm`` does this in one kernel where it runs (CUDA bf16
on Hopper or newer; CPU); elsewhere (fp16/fp32 on CUDA) a graph-safe fallback multiplies every
row by every group's matrix and keeps its own group's product, E times the FLOPs but no host
sync. The op is registered as a torch custom op with its own shape function, so `torch.compile`
(tc_piecewise) treats it as one opaque call whatever the dtype, instead of tracing into
``_grouped_mm``, whose meta function accepts bf16 only.
"""

from __future__ import annotations

import torch


def native(a: torch.Tensor) -> bool:
    if a.device.type == "cpu":
        return True
    return a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device)[0] >= 9


@torch.library.custom_op("capture_service::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a (M, K) rows sorted by group, b (G, K, N), offs (G,) int32 group ends -> (M, N)."""
    if native(a):
        return torch._grouped_mm(a, b, offs=offs)
    rows = torch.arange(a.shape[0], device=a.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True)  # (M,) each row's group
    out = torch.zeros(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
    for g in range(b.shape[0]):
        out = torch.where((group == g).unsqueeze(1), a @ b[g], out)
    return out


@grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[2])
