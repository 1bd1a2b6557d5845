"""Llama / Qwen2 decoder (Touvron et al. 2023, arXiv:2302.13971; Qwen2 adds qkv bias).

RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP, tied or untied embeddings,
written with tensor-parallel layers. The forward is split into per-layer halves around attention
(:meth:`DecoderLayer.pre_attention`, :meth:`DecoderLayer.post_attention`), so a graph runner can
capture the token-axis segments between attention calls (``breakable``) while the eager forward
is the same code run end to end. The request-layout-dependent tail (last-token gather, LM head)
is :meth:`CausalLM.logits`.

Shapes: T tokens (the token axis, maybe padded to a bucket), H hidden, Hq/Hkv heads on this
rank, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from service.model.arch_config import ArchConfig
from service.model.attention import AttentionFn, AttentionKey, AttentionRegistry, AttentionSpec
from service.model.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from service.model.rotary import RotaryEmbedding

MLP_TOKEN_CHUNK = 2048  # GEMMs of 2048 rows already run at full rate


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ArchConfig,
        layer_id: int,
        tp: TPGroup,
        rotary: RotaryEmbedding,
        registry: AttentionRegistry,
    ) -> None:
        super().__init__()
        self.num_heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        if cfg.num_key_value_heads % tp.world_size:
            raise ValueError(
                f"num_key_value_heads {cfg.num_key_value_heads} is not divisible by tp "
                f"{tp.world_size}; choose a tp that divides it"
            )
        self.num_kv_heads = cfg.num_key_value_heads // tp.world_size
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.q_size, cfg.kv_size, cfg.kv_size],
            tp,
            bias=cfg.attention_bias,
            shard_ids=["q", "k", "v"],
        )
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, tp)
        self.rotary = rotary
        self.key = AttentionKey(layer_id, "mha")
        registry.register(
            self.key,
            AttentionSpec(
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                scale=self.head_dim**-0.5,
                kv_layer=layer_id,
            ),
        )

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary(
            positions,
            q.reshape(t, self.num_heads, self.head_dim),
            k.reshape(t, self.num_kv_heads, self.head_dim),
        )
        return q.reshape(t, self.q_size), k.reshape(t, self.kv_size), v.contiguous()


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, tp, bias=False
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        # Compiled (tc_piecewise) pieces run it whole: inductor fuses the activation into one
        # kernel, and no size test enters the trace, so one trace serves every bucket.
        if torch.compiler.is_compiling() or x.shape[0] <= MLP_TOKEN_CHUNK:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        # Long batches run in token chunks: the (T, 2 * intermediate) activation is the largest
        # tensor of the forward, and a captured graph's pool keeps its peak for good.
        return torch.cat([self(part) for part in x.split(MLP_TOKEN_CHUNK)])


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ArchConfig,
        layer_id: int,
        tp: TPGroup,
        rotary: RotaryEmbedding,
        registry: AttentionRegistry,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, tp, rotary, registry)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def pre_attention(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Residual stream x (T, H) -> q (T, Hq*D), k, v (T, Hkv*D)."""
        return self.self_attn.qkv(self.input_layernorm(x), positions)

    def post_attention(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual stream x (T, H) and attention output (T, Hq*D) -> next residual (T, H)."""
        x = x + self.self_attn.o_proj(attn_out)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """The decoder. ``forward`` returns final hidden states; ``logits`` is the output tail."""

    def __init__(self, cfg: ArchConfig, tp: TPGroup, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.registry = AttentionRegistry()
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, tp, self.rotary, self.registry)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        )

    # Segments between attention calls: token-axis only, so they replay for any request layout.
    def first_segment(self, input_ids: torch.Tensor, positions: torch.Tensor):
        x = self.embed_tokens(input_ids)
        q, k, v = self.layers[0].pre_attention(x, positions)
        return x, q, k, v

    def middle_segment(
        self, i: int, x: torch.Tensor, attn_out: torch.Tensor, positions: torch.Tensor
    ):
        """Finish layer i-1 and start layer i."""
        x = self.layers[i - 1].post_attention(x, attn_out)
        q, k, v = self.layers[i].pre_attention(x, positions)
        return x, q, k, v

    def last_segment(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        return self.norm(self.layers[-1].post_attention(x, attn_out))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: AttentionFn
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, H)."""
        x, q, k, v = self.first_segment(input_ids, positions)
        for i in range(1, len(self.layers)):
            out = attend(q, k, v, self.layers[i - 1].self_attn.key)
            x, q, k, v = self.middle_segment(i, x, out, positions)
        out = attend(q, k, v, self.layers[-1].self_attn.key)
        return self.last_segment(x, out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Selected hidden states (N, H) -> logits (N, V) in float32."""
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        if isinstance(head, ParallelLMHead):
            return head.logits(hidden).float()
        local = F.linear(hidden, head.weight)
        return self.tp.all_gather_last_dim(local)[:, : self.cfg.vocab_size].float()
