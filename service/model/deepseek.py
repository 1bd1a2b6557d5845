"""DeepSeek V2 / V3 decoders (arXiv:2405.04434, arXiv:2412.19437): MLA attention
(service.model.mla), mixture-of-experts MLPs (service.model.moe) after the first
``first_k_dense_replace`` dense layers, RMSNorm with the residual add fused, YaRN rotary.

The model keeps :class:`~service.model.llama.CausalLM`'s runner contract: segments between
attention calls (each stores its layer's cache entry), :meth:`attend` between them,
:meth:`attention_io` for the static buffers of ``breakable``, and the output tail ``logits``.
A decode forward (the bound attention says so) computes only the MQA path's inputs.

Shapes: T tokens, H hidden.
"""

from __future__ import annotations

import re

import torch

from service.model.arch_config import ArchConfig
from service.model.attention import AttendCall, AttentionKey, AttentionRegistry, BoundAttention
from service.model.kernels import Kernels, RowOutput
from service.model.llama import MLP, CausalLM, PreNormLayer
from service.model.mla import MlaAttention, Rope
from service.model.moe import MoE
from service.model.parallel import TPGroup
from service.model.rotary import cos_sin_at

ShardId = object


class DeepseekDecoderLayer(PreNormLayer):
    def __init__(
        self,
        cfg: ArchConfig,
        layer_id: int,
        tp: TPGroup,
        registry: AttentionRegistry,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        self.self_attn = MlaAttention(cfg, layer_id, tp, registry, kernels)
        self.mlp = MoE(cfg, tp, kernels) if cfg.is_moe_layer(layer_id) else MLP(cfg, tp, kernels)
        self.add_norms(cfg, kernels)

    def pre_attention(
        self,
        x: RowOutput,
        residual: torch.Tensor | None,
        rope: Rope,
        decode: bool,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Layer input x (T, H) -> residual stream with x added, and the attention inputs
        (written into ``out``'s columns when given)."""
        h, residual = self.norm_input(x, residual)
        return residual, self.self_attn.inputs(h, rope, decode, out)

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor, decode: bool
    ) -> tuple[RowOutput, torch.Tensor]:
        """A dense layer's MLP output may be down's split-K partials (Kernels.row_linear)."""
        return self.mlp_residual(self.self_attn.output(attn_out, decode), residual)


class DeepseekLM(CausalLM):
    """DeepSeek V2/V3 with the same runner contract as the Llama family."""

    layer_class = DeepseekDecoderLayer

    @staticmethod
    def rotary_dim(cfg: ArchConfig) -> int:
        return cfg.mla.qk_rope_head_dim  # type: ignore[union-attr]

    def __init__(
        self, cfg: ArchConfig, tp: TPGroup, max_positions: int, kernels: Kernels | None = None
    ) -> None:
        if cfg.mla is None:
            raise ValueError("DeepseekLM needs an MLA config")
        super().__init__(cfg, tp, max_positions, kernels)

    def key(self, i: int) -> AttentionKey:
        return self.layers[i].self_attn.key_mqa

    def kv_entry(self) -> tuple[int, int, int]:
        """(parts, heads, width) of one token's KV-cache entry per layer: the latent and the
        rotary key, whole on every rank."""
        return 1, 1, self.cfg.mla.cache_dim  # type: ignore[union-attr]

    def attention_io(self) -> tuple[tuple[int, ...], int]:
        return self.layers[0].self_attn.io_widths()

    def _rope(self, positions: torch.Tensor) -> Rope:
        return cos_sin_at(self.rotary.cos_sin_cache, positions)  # type: ignore[return-value]

    def first_segment(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: BoundAttention,
        qkv_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Embed and start layer 0: -> residual (T, H) and its attention inputs, written into
        ``qkv_out`` (a runner's buffer of ``attention_io`` widths) when given; stored."""
        x = self.embed_tokens(input_ids)
        residual, inputs = self.layers[0].pre_attention(
            x, None, self._rope(positions), attention.decode, qkv_out
        )
        self.layers[0].self_attn.store(inputs, attention)
        return (residual, *inputs)

    def middle_segment(
        self,
        i: int,
        residual: torch.Tensor,
        attn_out: torch.Tensor,
        positions: torch.Tensor,
        attention: BoundAttention,
        qkv_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        decode = attention.decode
        x, residual = self.layers[i - 1].post_attention(attn_out, residual, decode)
        rope = self._rope(positions)
        residual, inputs = self.layers[i].pre_attention(x, residual, rope, decode, qkv_out)
        self.layers[i].self_attn.store(inputs, attention)
        return (residual, *inputs)

    def last_segment(
        self, residual: torch.Tensor, attn_out: torch.Tensor, decode: bool = False
    ) -> torch.Tensor:
        x, residual = self.layers[-1].post_attention(attn_out, residual, decode)
        return self.norm.add(x, residual)[0]

    def attend(
        self,
        i: int,
        inputs: tuple[torch.Tensor, ...],
        attention: BoundAttention,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.layers[i].self_attn.attend(inputs, attention, out)

    def attend_calls(
        self, i: int, inputs: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> tuple[AttendCall, ...]:
        return self.layers[i].self_attn.attend_calls(inputs, out)

    # ---- checkpoint names ------------------------------------------------------------------
    _EXPERT = re.compile(
        r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$"
    )
    _DENSE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(shared_experts\.)?(gate|up)_proj\.weight$")
    _LAYER = re.compile(r"^model\.layers\.(\d+)\.")

    def map_checkpoint_name(self, hf_name: str) -> tuple[str, ShardId] | None:
        """HF tensor name -> (our parameter name, shard id), or None for tensors not used
        (rotary tables, V3's multi-token-prediction layers past num_hidden_layers)."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        layer = self._LAYER.match(hf_name)
        if layer and int(layer.group(1)) >= self.cfg.num_hidden_layers:
            return None
        m = self._EXPERT.match(hf_name)
        if m:
            base = f"layers.{m.group(1)}.mlp.experts"
            expert = int(m.group(2))
            if m.group(3) == "down":
                return f"{base}.w2", expert
            return f"{base}.w13", (expert, 0 if m.group(3) == "gate" else 1)
        m = self._DENSE.match(hf_name)
        if m:
            return f"layers.{m.group(1)}.mlp.{m.group(2) or ''}gate_up_proj.weight", (
                0 if m.group(3) == "gate" else 1
            )
        return hf_name.removeprefix("model."), None

    def checkpoint_shards(self, name: str) -> tuple[ShardId, ...] | None:
        """The shards of the routed experts' stacked parameters (one per expert, gate and up
        apart), or None for the loader's default."""
        experts = self.cfg.moe.num_experts if self.cfg.moe else 0
        if name.endswith("experts.w13"):
            return tuple((e, p) for e in range(experts) for p in (0, 1))
        if name.endswith("experts.w2"):
            return tuple(range(experts))
        return None
