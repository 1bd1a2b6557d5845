"""Llama / Qwen2 decoder (Touvron et al. 2023, arXiv:2302.13971; Qwen2 adds qkv bias).

RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP, tied or untied embeddings,
written with tensor-parallel layers. The residual stream is carried through the layers beside
each layer's output, so every norm after the first adds the residual in the same kernel
(``add_rms_norm``); the elementwise kernels come from :mod:`service.model.kernels`.

The forward is split into per-layer halves around attention (:meth:`DecoderLayer.pre_attention`,
:meth:`DecoderLayer.post_attention`) and composed into segments (:meth:`CausalLM.first_segment`,
:meth:`CausalLM.middle_segment`, :meth:`CausalLM.last_segment`), so a graph runner can capture
the token-axis segments between attention calls (``breakable``) while the eager forward is the
same code run end to end. Each segment ends with its layer's K/V written to the cache
(``attention.store``), which is token-axis work too. The request-layout-dependent tail
(last-token gather, LM head) is :meth:`CausalLM.logits`.

Shapes: T tokens (the token axis, maybe padded to a bucket), H hidden, Hq/Hkv heads on this
rank, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from service.model.arch_config import ArchConfig
from service.model.attention import (
    AttendCall,
    AttentionKey,
    AttentionRegistry,
    AttentionSpec,
    BoundAttention,
    KVTarget,
)
from service.model.kernels import Kernels, RowOutput, SplitK, Unprojected
from service.model.mlp_chunks import chunk_rows
from service.model.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from service.model.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add(self, x: RowOutput, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), one kernel where the kernels fuse it (x may be a
        projection's unsummed split-K partials, Kernels.row_linear)."""
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ArchConfig,
        layer_id: int,
        tp: TPGroup,
        registry: AttentionRegistry,
        kernels: Kernels,
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
        self.kernels = kernels
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
        self,
        h: torch.Tensor,
        rope: object,
        out: torch.Tensor | None = None,
        kv: KVTarget | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed hidden (T, H) -> rotated q (T, Hq*D), k and v (T, Hkv*D); with ``kv``, k and
        v are also stored there (in the same kernel where the kernels can).

        The projection is written into ``out`` (T, (Hq + 2 Hkv) D) when given; q, k, v are
        column slices of it (no copies), rotated in place where the kernels do so.
        """
        sizes = (self.q_size, self.kv_size, self.kv_size)
        if kv is not None:
            # the bias, if any, added by the rotary kernel where it can (one GEMM epilogue less)
            bias = self.qkv_proj.bias
            if bias is not None and not self.kernels.rope_adds_bias(h.shape[0]):
                bias = None
            qkv = self.qkv_proj(h, out=out, add_bias=bias is None)
            return self.kernels.rope_qkv_store(rope, qkv, sizes, self.head_dim, kv, bias)
        qkv = self.qkv_proj(h, out=out)
        return self.kernels.rope_qkv(rope, qkv, sizes, self.head_dim)


class MLP(nn.Module):
    """SwiGLU. ``intermediate_size`` defaults to the config's; DeepSeek's shared experts are
    this MLP at their own width."""

    def __init__(
        self, cfg: ArchConfig, tp: TPGroup, kernels: Kernels, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter] * 2, tp, bias=False)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp)
        self.kernels = kernels

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        """The output before the all-reduce (a MoE layer adds the routed experts first)."""
        return self.down_proj.partial(self.kernels.gate_up_silu(x, self.gate_up_proj))

    def forward(self, x: torch.Tensor) -> RowOutput:  # (T, H) -> (T, H)
        """The output feeds the next add-RMSNorm only: at the token counts where the split-K
        kernel was chosen it is down's unsummed partials (Kernels.row_linear)."""
        # Compiled (tc_piecewise) pieces run it whole: inductor fuses the activation into one
        # kernel (or, with the fused gate_up kernel, one opaque op picks per call), and no size
        # test enters the trace, so one trace serves every bucket.
        rows = x.shape[0]
        if torch.compiler.is_compiling():
            step = rows
        else:
            step = chunk_rows(rows, self.gate_up_proj.local_sizes[0], x.element_size())
        if step >= rows:
            return self.kernels.row_linear(
                self.kernels.gate_up_silu(x, self.gate_up_proj), self.down_proj
            )
        # Long batches run in equal token chunks (service.model.mlp_chunks: the intermediates
        # are the forward's largest tensors, and a captured graph's pool keeps its peak), each
        # written into its rows of one output by one GEMM (never split-K partials, which only
        # the whole path's row_linear returns).
        out = x.new_empty(rows, self.down_proj.weight.shape[0])
        for start in range(0, rows, step):
            part = slice(start, start + step)
            self.down_proj(self.kernels.gate_up_silu(x[part], self.gate_up_proj), out=out[part])
        return out


class PreNormLayer(nn.Module):
    """The residual stream of a pre-norm decoder layer, shared by the families: norm, attention,
    add + norm, MLP. A subclass builds ``self_attn`` and ``mlp``, then calls :meth:`add_norms`."""

    mlp: nn.Module

    def add_norms(self, cfg: ArchConfig, kernels: Kernels) -> None:
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)

    def norm_input(
        self, x: RowOutput, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous layer's output x (T, H) (the embeddings for layer 0, whose residual is
        None) -> the attention's normed input (T, H), the residual stream with x added."""
        if residual is None:  # layer 0: x is the embeddings
            if isinstance(x, (SplitK, Unprojected)):
                raise TypeError("layer 0's input is the embeddings, not a projection's output")
            return self.input_layernorm(x), x
        return self.input_layernorm.add(x, residual)

    def mlp_residual(self, x: RowOutput, residual: torch.Tensor) -> tuple[RowOutput, torch.Tensor]:
        """The attention's projected output x (T, H) -> MLP output (T, H), residual with x
        added."""
        h, residual = self.post_attention_layernorm.add(x, residual)
        return self.mlp(h), residual


class DecoderLayer(PreNormLayer):
    def __init__(
        self,
        cfg: ArchConfig,
        layer_id: int,
        tp: TPGroup,
        registry: AttentionRegistry,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, tp, registry, kernels)
        self.mlp = MLP(cfg, tp, kernels)
        self.add_norms(cfg, kernels)

    def pre_attention(
        self,
        x: RowOutput,
        residual: torch.Tensor | None,
        rope: object,
        qkv_out: torch.Tensor | None = None,
        kv: KVTarget | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The previous layer's output x (T, H) (the embeddings for layer 0, whose residual is
        None) -> q (T, Hq*D), k, v (T, Hkv*D) and the residual stream (T, H) with x added; k
        and v stored at ``kv`` when given."""
        h, residual = self.norm_input(x, residual)
        q, k, v = self.self_attn.qkv(h, rope, qkv_out, kv)
        return q, k, v, residual

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[RowOutput, torch.Tensor]:
        """Attention output (T, Hq*D) and residual (T, H) -> MLP output (T, H), residual with
        the attention output added."""
        o = self.self_attn.kernels.row_linear(attn_out, self.self_attn.o_proj)
        return self.mlp_residual(o, residual)


class CausalLM(nn.Module):
    """The decoder. ``forward`` returns final hidden states; ``logits`` is the output tail.

    A family with other layers (service.model.deepseek) sets ``layer_class`` and
    ``rotary_dim`` and keeps everything else: embedding, final norm, LM head, the runner
    contract."""

    layer_class: type[nn.Module] = DecoderLayer

    @staticmethod
    def rotary_dim(cfg: ArchConfig) -> int:
        return cfg.head_dim

    def __init__(
        self, cfg: ArchConfig, tp: TPGroup, max_positions: int, kernels: Kernels | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.kernels = kernels or Kernels()
        self.registry = AttentionRegistry()
        self.rotary = RotaryEmbedding(
            self.rotary_dim(cfg), max_positions, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, i, tp, self.registry, self.kernels)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.kernels)
        self.lm_head = (
            None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        )
        # looked up per layer between segment replays: a tuple, not a walk through modules
        self.attention_keys = tuple(self.key(i) for i in range(len(self.layers)))

    def key(self, i: int) -> AttentionKey:
        return self.layers[i].self_attn.key

    def kv_entry(self) -> tuple[int, int, int]:
        """(parts, heads on this rank, head dim) of one token's KV-cache entry per layer."""
        return 2, self.layers[0].self_attn.num_kv_heads, self.cfg.head_dim

    def attention_io(self) -> tuple[tuple[int, ...], int]:
        """Widths of what a segment hands to attention (q, k, v: columns of one qkv buffer)
        and of what attention hands to the next segment (the output of a ``breakable``
        prefill)."""
        attn = self.layers[0].self_attn
        return (attn.q_size, attn.kv_size, attn.kv_size), attn.q_size

    def attend(
        self,
        i: int,
        inputs: tuple[torch.Tensor, ...],
        attention: BoundAttention,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer i's attention over the inputs its segment produced -> (T, Hq*D)."""
        q, k, v = inputs
        return attention(q, k, v, self.attention_keys[i], out)

    def attend_calls(
        self, i: int, inputs: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> tuple[AttendCall, ...]:
        """What :meth:`attend` of layer i into ``out`` does, as attention calls over these
        tensors: a segment runner makes them without coming back through the model."""
        q, k, v = inputs
        return (AttendCall(q, k, v, self.attention_keys[i], out),)

    # Segments between attention calls: token-axis only, so they replay for any request layout.
    def first_segment(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: BoundAttention,
        qkv_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Embed and start layer 0: -> residual (T, H), q, k, v; layer 0's K/V stored."""
        rope = self.kernels.rope_context(positions, self.rotary.cos_sin_cache)
        x = self.embed_tokens(input_ids)
        return self._start_layer(0, x, None, rope, attention, qkv_out)

    def middle_segment(
        self,
        i: int,
        residual: torch.Tensor,
        attn_out: torch.Tensor,
        positions: torch.Tensor,
        attention: BoundAttention,
        qkv_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Finish layer i-1 and start layer i; layer i's K/V stored."""
        rope = self.kernels.rope_context(positions, self.rotary.cos_sin_cache)
        x, residual = self.layers[i - 1].post_attention(attn_out, residual)
        return self._start_layer(i, x, residual, rope, attention, qkv_out)

    def _start_layer(
        self,
        i: int,
        x: RowOutput,
        residual: torch.Tensor | None,
        rope: object,
        attention: BoundAttention,
        qkv_out: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i up to its attention, its K/V stored: -> residual (T, H), q, k, v. Where the
        kernels rotate and store in one kernel, the attention says where K/V go and the kernel
        writes them; otherwise the attention stores the rotated k and v."""
        key = self.key(i)
        target = attention.kv_target(key) if self.kernels.stores_kv() else None
        q, k, v, residual = self.layers[i].pre_attention(x, residual, rope, qkv_out, target)
        if target is None:
            attention.store(k, v, key)
        return residual, q, k, v

    def last_segment(
        self, residual: torch.Tensor, attn_out: torch.Tensor, decode: bool = False
    ) -> torch.Tensor:
        """Finish the last layer and apply the final norm: -> final hidden states (T, H)."""
        x, residual = self.layers[-1].post_attention(attn_out, residual)
        return self.norm.add(x, residual)[0]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: BoundAttention
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, H). The segments and
        :meth:`attend` run end to end: the same code a segment runner captures piecewise."""
        state = self.first_segment(input_ids, positions, attention)
        hidden = self.forward_span(0, len(self.layers), state, positions, attention)
        if not isinstance(hidden, torch.Tensor):  # a span to the last layer ends the forward
            raise RuntimeError("forward_span over every layer returned a state, not hidden states")
        return hidden

    def forward_span(
        self,
        start: int,
        stop: int,
        state: tuple[torch.Tensor, ...],
        positions: torch.Tensor,
        attention: BoundAttention,
        qkv_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """Layers [start, stop) from ``state``: the residual (T, H) and layer ``start``'s
        attention inputs, as :meth:`first_segment` and :meth:`middle_segment` return them.
        Returns the state layer ``stop`` starts from (its attention inputs written into
        ``qkv_out`` when given), or the final hidden states (T, H) when ``stop`` is the last
        layer. ``full`` captures a forward as a chain of spans."""
        residual, *inputs = state
        for i in range(start, stop):
            out = self.attend(i, tuple(inputs), attention)
            if i + 1 == len(self.layers):
                return self.last_segment(residual, out, attention.decode)
            into = qkv_out if i + 1 == stop else None  # the state handed to the next span
            residual, *inputs = self.middle_segment(i + 1, residual, out, positions, attention,
                                                    qkv_out=into)  # fmt: skip
        return (residual, *inputs)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Selected hidden states (N, H) -> logits (N, V) in float32."""
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        if isinstance(head, ParallelLMHead):
            return head.logits(hidden).float()
        local = F.linear(hidden, head.weight)
        return self.tp.all_gather_last_dim(local)[:, : self.cfg.vocab_size].float()
