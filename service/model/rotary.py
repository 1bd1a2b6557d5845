"""Rotary position embeddings (RoFormer, arXiv:2104.09864) in the Llama "rotate half" layout.

Supports the checkpoint's ``rope_theta`` and the ``linear`` and ``llama3`` rope scalings.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from service.model.arch_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling.rope_type == "linear":
        inv = inv / scaling.factor
    elif scaling.rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, blended, scaled)
    return inv.float()


class RotaryEmbedding(nn.Module):
    """The cos/sin table, built once in float32: (P, D) with cos in the first half of each row
    and sin in the second (the layout FlashInfer's rotary kernel reads). The rotation itself is a
    kernel (service.model.kernels); a forward only indexes the table with device positions, which
    keeps rotary graph-safe (no host values)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling):
        super().__init__()
        inv = inverse_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # (P, D/2)
        self.register_buffer(
            "cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False
        )
        self.head_dim = head_dim
