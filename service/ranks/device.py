"""Start-up resolution of the device, dtype, context length and KV budget of one rank."""

from __future__ import annotations

import torch

from service.config import (
    DEFAULT_CHUNKED_PREFILL_CPU,
    DEFAULT_CHUNKED_PREFILL_CUDA,
    DEFAULT_CONTEXT_LENGTH_CAP,
    EngineConfig,
)
from service.errors import ConfigError
from service.model.arch_config import ArchConfig

CPU_KV_BUDGET_BYTES = 256 << 20
CUDA_KV_FRACTION = 0.6  # of the memory free after loading weights; the rest: activations, graphs


def resolve_device(cfg: EngineConfig, local_gpu: int = 0) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was given but no CUDA device is visible")
        return torch.device("cuda", local_gpu)
    return torch.device("cpu")


def resolve_dtype(cfg: EngineConfig, arch: ArchConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    if device.type == "cpu":
        return torch.float32  # CPU bf16 matmuls are slow and less exact; tests compare in fp32
    return {"float16": torch.float16, "float32": torch.bfloat16}.get(
        arch.torch_dtype, torch.bfloat16
    )


def resolve_context_length(cfg: EngineConfig, arch: ArchConfig) -> int:
    if cfg.context_length is None:
        return min(arch.max_position_embeddings, DEFAULT_CONTEXT_LENGTH_CAP)
    if cfg.context_length > arch.max_position_embeddings:
        raise ConfigError(
            f"--context-length {cfg.context_length} exceeds the model's "
            f"max_position_embeddings {arch.max_position_embeddings}; lower --context-length"
        )
    return cfg.context_length


def resolve_chunked_prefill(cfg: EngineConfig, device: torch.device) -> int:
    if cfg.chunked_prefill_size is not None:
        return cfg.chunked_prefill_size
    return DEFAULT_CHUNKED_PREFILL_CUDA if device.type == "cuda" else DEFAULT_CHUNKED_PREFILL_CPU


def resolve_kv_budget(cfg: EngineConfig, device: torch.device) -> int:
    if cfg.kv_cache_memory_bytes is not None:
        return cfg.kv_cache_memory_bytes
    if device.type == "cpu":
        return CPU_KV_BUDGET_BYTES
    free, _total = torch.cuda.mem_get_info(device)
    return int(free * CUDA_KV_FRACTION)
