"""DeepSeek's multi-head latent attention (MLA, arXiv:2405.04434) with its two attention paths.

Per token and layer the KV cache keeps one entry: the normed KV latent (``kv_lora_rank``) and
the shared rotary key (``qk_rope_head_dim``), 576 wide for V2-Lite shapes. Two paths attend,
both registered under the layer's id (DESIGN invariant 8):

- ``mha`` (prefill of requests without a cached prefix): keys and values are expanded from this
  pass's latents (``kv_b_proj``) into full heads, q/k head ``qk_nope + qk_rope`` (192), value
  head ``v_head_dim`` (128, zero-padded to 192 so both paths return query-shaped outputs); it
  attends over this pass's tokens only.
- ``mqa`` (prefill of requests on a cached prefix, and every decode step): the key projection
  is absorbed into the query (q_nope W_UK, per head), so one 576-wide key head, read straight
  from the cache, serves every query head; values are the latent part of the same entries, and
  the value projection W_UV is applied after attention.

Each path leaves the other's rows zero, so the layer adds both outputs; a prefill batch that
mixes fresh and continued requests runs both in the same forward.

Shapes: T tokens, H query heads on this rank, N = qk_nope, R = qk_rope, L = kv_lora_rank,
V = v_head_dim, C = L + R (the cache entry), Q = N + R.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from service.errors import CheckpointError
from service.model.arch_config import ArchConfig, MlaConfig
from service.model.attention import (
    MLA_LATENT,
    MLA_NEW,
    AttendCall,
    AttentionKey,
    AttentionRegistry,
    AttentionSpec,
    BoundAttention,
)
from service.model.kernels import Kernels
from service.model.llama import RMSNorm
from service.model.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup
from service.model.rotary import yarn_mscale

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: (T, 1, R/2) float32


class ReplicatedLinear(nn.Module):
    """A projection every rank holds whole (MLA's down-projections to the latents)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def rope_interleaved(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """DeepSeek's rotary over interleaved pairs (x0, x1), (x2, x3), ... of x (T, h, R).

    The output lists the rotated even members, then the odd ones: a fixed permutation of the
    pairs' layout, the same for queries and keys, so every dot product is unchanged."""
    cos, sin = rope
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def softmax_scale(cfg: ArchConfig) -> float:
    """1/sqrt(Q), times YaRN's mscale squared where the checkpoint sets mscale_all_dim."""
    scale = cfg.mla.qk_head_dim**-0.5  # type: ignore[union-attr]
    rs = cfg.rope_scaling
    if rs.rope_type == "yarn" and rs.mscale_all_dim:
        scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    return scale


class MlaAttention(nn.Module):
    def __init__(
        self,
        cfg: ArchConfig,
        layer_id: int,
        tp: TPGroup,
        registry: AttentionRegistry,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        m: MlaConfig = cfg.mla  # type: ignore[assignment]
        if cfg.attention_bias:
            raise CheckpointError("MLA with attention_bias is not supported (no DeepSeek uses it)")
        if m.v_head_dim > m.qk_head_dim:
            raise CheckpointError("MLA with v_head_dim > qk_nope_head_dim + qk_rope_head_dim")
        self.m = m
        self.num_heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, [heads * m.qk_head_dim], tp, bias=False)
        else:
            self.q_a_proj = ReplicatedLinear(h, m.q_lora_rank)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps, kernels)
            self.q_b_proj = ColumnParallelLinear(
                m.q_lora_rank, [heads * m.qk_head_dim], tp, bias=False
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, m.cache_dim)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps, kernels)
        self.kv_b_proj = ColumnParallelLinear(
            m.kv_lora_rank, [heads * (m.qk_nope_head_dim + m.v_head_dim)], tp, bias=False
        )
        self.o_proj = RowParallelLinear(heads * m.v_head_dim, h, tp)
        scale = softmax_scale(cfg)
        self.key_mha = AttentionKey(layer_id, "mha")
        self.key_mqa = AttentionKey(layer_id, "mqa")
        n = self.num_heads
        mha = AttentionSpec(n, n, m.qk_head_dim, scale, layer_id, MLA_NEW)
        mqa = AttentionSpec(n, 1, m.cache_dim, scale, layer_id, MLA_LATENT)
        registry.register(self.key_mha, mha)
        registry.register(self.key_mqa, mqa)

    @property
    def mha_width(self) -> int:
        return self.num_heads * self.m.qk_head_dim

    @property
    def mqa_width(self) -> int:
        return self.num_heads * self.m.cache_dim

    def io_widths(self) -> tuple[tuple[int, ...], int]:
        """Prefill: widths of (q_mha, k_mha, v_mha, q_mqa, entry) and of the attention output."""
        w, c = self.mha_width, self.mqa_width
        return (w, w, w, c, self.m.cache_dim), w + c

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj's weight per head: W_UK (H, N, L) and W_UV (H, V, L)."""
        m = self.m
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def inputs(
        self, h: torch.Tensor, rope: Rope, decode: bool, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Normed hidden (T, H_model) -> the attention inputs: decode (q_mqa (T, H*C),
        entry (T, C)); prefill (q_mha, k_mha, v_mha (T, H*Q), q_mqa, entry). ``entry`` is what
        the cache stores. A prefill writes them into the columns of ``out`` (T, sum of
        ``io_widths``) when given (``breakable``'s buffer), so they are assembled once, where
        attention reads them."""
        m, t, n = self.m, h.shape[0], self.num_heads
        if m.q_lora_rank is None:
            q = self.q_proj(h)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q = q.view(t, n, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv_a = self.kv_a_proj_with_mqa(h)  # (T, C)
        latent = self.kv_a_layernorm(kv_a[:, : m.kv_lora_rank].contiguous())  # (T, L)
        q_pe = rope_interleaved(q_pe, rope)  # (T, H, R)
        k_pe = rope_interleaved(kv_a[:, m.kv_lora_rank :].unsqueeze(1), rope)  # (T, 1, R)
        w_uk, _ = self._w_uk_uv()
        q_absorbed = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (T, H, L)
        if decode:
            entry = torch.cat((latent, k_pe.squeeze(1)), dim=-1)  # (T, C)
            return torch.cat((q_absorbed, q_pe), dim=-1).reshape(t, -1), entry
        kv = self.kv_b_proj(latent).view(t, n, -1)  # (T, H, N + V)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        if out is None:
            entry = torch.cat((latent, k_pe.squeeze(1)), dim=-1)
            q_mqa = torch.cat((q_absorbed, q_pe), dim=-1).reshape(t, -1)  # (T, H*C)
            k_mha = torch.cat((k_nope, k_pe.expand(t, n, m.qk_rope_head_dim)), dim=-1)
            q_mha = torch.cat((q_nope, q_pe), dim=-1)
            v_mha = F.pad(v, (0, m.qk_head_dim - m.v_head_dim))  # query-shaped output
            return q_mha.reshape(t, -1), k_mha.reshape(t, -1), v_mha.reshape(t, -1), q_mqa, entry
        widths, _ = self.io_widths()
        views = out.split(list(widths), dim=-1)
        heads = (m.qk_head_dim, m.qk_head_dim, m.qk_head_dim, m.cache_dim)
        q_mha, k_mha, v_mha, q_mqa = (x.view(t, n, d) for x, d in zip(views, heads, strict=False))
        for dst, parts in (
            (q_mha, (q_nope, q_pe)),
            (k_mha, (k_nope, k_pe)),
            (v_mha, (v, None)),  # zero-padded to the query's width
            (q_mqa, (q_absorbed, q_pe)),
            (views[4], (latent, k_pe.squeeze(1))),
        ):
            first = parts[0].shape[-1]
            dst[..., :first].copy_(parts[0])
            if parts[1] is None:
                dst[..., first:].zero_()
            else:
                dst[..., first:].copy_(parts[1])
        return views

    def store(self, inputs: tuple[torch.Tensor, ...], attention: BoundAttention) -> None:
        entry = inputs[-1]
        attention.store(entry, entry, self.key_mqa)

    def attend(
        self,
        inputs: tuple[torch.Tensor, ...],
        attention: BoundAttention,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Both paths (prefill) or the MQA path (decode) -> (T, H*Q + H*C) or (T, H*C)."""
        if attention.decode:
            q_mqa, entry = inputs
            return attention(q_mqa, entry, entry, self.key_mqa, out)
        q_mha, k_mha, v_mha, q_mqa, entry = inputs
        if out is None:  # eager and compiled forwards
            return torch.cat(
                (
                    attention(q_mha, k_mha, v_mha, self.key_mha),
                    attention(q_mqa, entry, entry, self.key_mqa),
                ),
                dim=-1,
            )
        w = self.mha_width  # a runner's buffer: each path writes its columns
        for res, dst in (
            (attention(q_mha, k_mha, v_mha, self.key_mha, out[:, :w]), out[:, :w]),
            (attention(q_mqa, entry, entry, self.key_mqa, out[:, w:]), out[:, w:]),
        ):
            if res.data_ptr() != dst.data_ptr():
                dst.copy_(res)
        return out

    def attend_calls(
        self, inputs: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> tuple[AttendCall, ...]:
        """:meth:`attend` of a prefill into ``out``: each path into its columns."""
        q_mha, k_mha, v_mha, q_mqa, entry = inputs
        w = self.mha_width
        return (
            AttendCall(q_mha, k_mha, v_mha, self.key_mha, out[:, :w]),
            AttendCall(q_mqa, entry, entry, self.key_mqa, out[:, w:]),
        )

    def output(self, attn_out: torch.Tensor, decode: bool) -> torch.Tensor:
        """The attention output (T, H*Q + H*C), or (T, H*C) in decode -> o_proj's (T, H_model)."""
        m, t, n = self.m, attn_out.shape[0], self.num_heads
        latent_out = attn_out[:, -self.mqa_width :].view(t, n, m.cache_dim)[..., : m.kv_lora_rank]
        _, w_uv = self._w_uk_uv()
        o = torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # (T,H,V)
        if not decode:  # the MHA path's rows (the MQA path left them zero, and vice versa)
            o = o + attn_out[:, : self.mha_width].view(t, n, m.qk_head_dim)[..., : m.v_head_dim]
        return self.o_proj(o.reshape(t, n * m.v_head_dim))
