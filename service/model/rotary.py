"""Rotary position embeddings (RoFormer, arXiv:2104.09864) in the Llama "rotate half" layout.

Supports the checkpoint's ``rope_theta`` and the ``linear``, ``llama3`` and ``yarn`` rope
scalings (YaRN as DeepSeek configures it: frequencies blended by a linear ramp between
``beta_fast`` and ``beta_slow`` rotations, cos/sin scaled by the mscale ratio).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from service.model.arch_config import RopeScaling


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: RopeScaling) -> float:
    """The factor YaRN applies to cos and sin (1.0 for DeepSeek's mscale == mscale_all_dim)."""
    if scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return yarn_mscale(scaling.factor)


def yarn_inverse_frequencies(dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN's blend of interpolated and extrapolated frequencies (float32, as the reference
    implementations compute it)."""

    def correction_dim(rotations: float) -> float:
        old = s.original_max_position_embeddings
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp  # 1 where the rotation is fast enough to keep it as trained
    return (1.0 / (s.factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    if scaling.rope_type == "yarn":
        return yarn_inverse_frequencies(head_dim, theta, scaling)
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


def cos_sin_at(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(cos, sin) of the table at each position, each (T, 1, D/2) float32: looked up once per
    forward and shared by every layer."""
    return tuple(cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1))


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
        factor = yarn_attention_factor(scaling)
        self.register_buffer(
            "cos_sin_cache",
            torch.cat((freqs.cos() * factor, freqs.sin() * factor), dim=-1),
            persistent=False,
        )
        self.head_dim = head_dim
