"""The architecture of a decoder checkpoint, read from a Hugging Face `config.json` (no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.errors import CheckpointError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (arXiv:2309.00071), as DeepSeek's checkpoints configure it
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention (arXiv:2405.04434), per attention head."""

    q_lora_rank: int | None  # None: a plain q projection
    kv_lora_rank: int  # width of the compressed KV latent
    qk_nope_head_dim: int  # the part of q/k without rotary
    qk_rope_head_dim: int  # the decoupled rotary part (one shared key head)
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """One KV-cache entry per token and layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeConfig:
    """Routed and shared experts (DeepSeekMoE, arXiv:2401.06066; V3's sigmoid routing)."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_shared_experts: int
    first_k_dense_replace: int  # the first layers keep a dense MLP
    scoring: str  # softmax (V2) | sigmoid (V3)
    topk_method: str  # greedy | group_limited_greedy | noaux_tc
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    mla: MlaConfig | None = None  # DeepSeek V2/V3
    moe: MoeConfig | None = None
    quantization: str | None = None  # the checkpoint's quant_method (e.g. V3's "fp8"), if any

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.first_k_dense_replace

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        if self.mla is None:
            attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
            if self.attention_bias:
                attn += self.q_size + 2 * self.kv_size
        else:
            m, heads = self.mla, self.num_attention_heads
            q = heads * m.qk_head_dim
            q_proj = h * q if m.q_lora_rank is None else (h + q) * m.q_lora_rank + m.q_lora_rank
            attn = q_proj + h * m.cache_dim + m.kv_lora_rank
            attn += m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
            attn += heads * m.v_head_dim * h
        total = v * h + h + (0 if self.tie_word_embeddings else v * h)
        for layer in range(self.num_hidden_layers):
            if self.is_moe_layer(layer):
                e = self.moe  # type: ignore[union-attr]
                mlp = 3 * h * e.moe_intermediate_size * (e.num_experts + e.num_shared_experts)
                mlp += e.num_experts * h
            else:
                mlp = 3 * h * i
            total += attn + mlp + 2 * h
        return total


def parse_arch_config(raw: dict[str, Any], source: str = "config.json") -> ArchConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    try:
        mla = parse_mla(raw) if family.startswith("deepseek") else None
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rs = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        rope_type = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
        if rope_type not in ROPE_TYPES:
            raise CheckpointError(
                f"{source}: unsupported rope_scaling type {rope_type!r}; "
                f"supported: {', '.join(ROPE_TYPES)}"
            )
        rope_theta = raw.get("rope_theta", rs.get("rope_theta", 10000.0) if rs else 10000.0)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ArchConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(mla.qk_head_dim if mla else (raw.get("head_dim") or hidden // heads)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=RopeScaling(
                rope_type=rope_type,
                factor=float(rs.get("factor", 1.0)) if rs else 1.0,
                low_freq_factor=float(rs.get("low_freq_factor", 1.0)) if rs else 1.0,
                high_freq_factor=float(rs.get("high_freq_factor", 4.0)) if rs else 4.0,
                original_max_position_embeddings=int(
                    rs.get("original_max_position_embeddings", 8192) if rs else 8192
                ),
                beta_fast=float(rs.get("beta_fast") or 32.0) if rs else 32.0,
                beta_slow=float(rs.get("beta_slow") or 1.0) if rs else 1.0,
                mscale=float(rs.get("mscale") or 0.0) if rs else 0.0,
                mscale_all_dim=float(rs.get("mscale_all_dim") or 0.0) if rs else 0.0,
                attention_factor=(
                    float(rs["attention_factor"]) if rs.get("attention_factor") else None
                ),
            ),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", family == "qwen2")),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            mla=mla,
            moe=parse_moe(raw, source, v3=family == "deepseek_v3") if mla else None,
            quantization=(
                str((raw.get("quantization_config") or {}).get("quant_method", "unknown"))
                if raw.get("quantization_config")
                else None
            ),
        )
    except KeyError as exc:
        raise CheckpointError(f"{source}: missing required field {exc.args[0]!r}") from None


def parse_mla(raw: dict[str, Any]) -> MlaConfig:
    q_lora = raw.get("q_lora_rank")
    return MlaConfig(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
        qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
        v_head_dim=int(raw["v_head_dim"]),
    )


def parse_moe(raw: dict[str, Any], source: str, v3: bool) -> MoeConfig | None:
    """The routed experts of a DeepSeek config, or None when it has none (a dense model).
    ``v3``: V3's defaults (sigmoid scoring, noaux_tc) where the config names none."""
    experts = raw.get("n_routed_experts")
    if not experts:
        return None
    scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if scoring not in ("softmax", "sigmoid"):
        raise CheckpointError(f"{source}: unsupported scoring_func {scoring!r}")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise CheckpointError(
            f"{source}: unsupported topk_method {method!r}; supported: greedy, "
            "group_limited_greedy, noaux_tc"
        )
    if int(raw.get("moe_layer_freq") or 1) != 1:
        raise CheckpointError(f"{source}: moe_layer_freq other than 1 is not supported")
    groups = int(raw.get("n_group") or 1)
    if experts % groups:
        raise CheckpointError(f"{source}: n_routed_experts {experts} is not divisible by n_group")
    return MoeConfig(
        num_experts=int(experts),
        top_k=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        num_shared_experts=int(raw.get("n_shared_experts") or 0),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        scoring=scoring,
        topk_method=method,
        num_groups=groups,
        topk_groups=int(raw.get("topk_group") or 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
    )


def load_arch_config(model_dir: Path) -> ArchConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"{path} not found; --model must be a Hugging Face checkpoint directory "
            "with config.json and model.safetensors"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    return parse_arch_config(raw, str(path))
