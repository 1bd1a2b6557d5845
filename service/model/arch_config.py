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
}


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + head


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
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rs = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        rope_type = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise CheckpointError(
                f"{source}: unsupported rope_scaling type {rope_type!r}; "
                "supported: default, linear, llama3"
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
            head_dim=int(raw.get("head_dim") or hidden // heads),
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
            ),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", family == "qwen2")),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )
    except KeyError as exc:
        raise CheckpointError(f"{source}: missing required field {exc.args[0]!r}") from None


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
