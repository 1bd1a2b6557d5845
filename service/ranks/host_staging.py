"""Per-step host arrays written with numpy and sent to the device in one copy.

Small torch CPU ops cost microseconds each and release the GIL that the HTTP thread competes
for, so the per-step layouts (batch tensors, request-row writes, FlashInfer's paged layout) are
written through numpy views of one host tensor. On CUDA that tensor is pinned, so its copy is a
DMA from the buffer itself, not a driver staging copy, and can be queued without waiting.
"""

from __future__ import annotations

import numpy as np
import torch


def host_buffer(n: int, dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, np.ndarray]:
    """An (n,) host tensor and its numpy view; pinned when it feeds a copy to a CUDA device."""
    t = torch.empty(n, dtype=dtype, pin_memory=pin)
    return t, t.numpy()


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``: a non-blocking copy from its pinned memory on CUDA, the host
    tensor itself on CPU."""
    return host.to(device, non_blocking=True) if device.type == "cuda" else host
