"""Load a Hugging Face checkpoint directory (config.json + safetensors) into a rank's shard.

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) checkpoints
are read lazily with ``safe_open(...).get_slice``: each rank reads only its rows or columns of
every tensor. ``load_format="random"`` builds the same model from ``config.json`` alone with
seeded random weights (for benchmarks of large shapes without a download).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from service.errors import CheckpointError
from service.model.arch_config import ArchConfig, load_arch_config
from service.model.kernels import Kernels
from service.model.llama import CausalLM
from service.model.parallel import TPGroup, copy_checked

log = logging.getLogger(__name__)

# HF name pattern -> (our parameter name template, shard id of a fused parameter)
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def map_name(hf_name: str) -> tuple[str, str | int | None] | None:
    """HF tensor name -> (our parameter name, shard id), or None for tensors we do not use."""
    if _IGNORED.search(hf_name):
        return None
    m = _LAYER.match(hf_name)
    if m and m.group(3) in _FUSED:
        fused, shard = _FUSED[m.group(3)]
        return f"layers.{m.group(1)}.{m.group(2)}.{fused}.{m.group(4)}", shard
    if hf_name.startswith("model."):
        return hf_name[len("model.") :], None
    if hf_name.startswith("lm_head."):
        return hf_name, None
    return hf_name, None


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(
        f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json "
        "(use --load-format random to run from config.json alone)"
    )


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, object]]:
    """(name, lazy slice) for every tensor of the checkpoint."""
    with ExitStack() as stack:
        for path in checkpoint_files(model_dir):
            f = stack.enter_context(safe_open(str(path), framework="pt"))
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_slice(name)


def default_shards(name: str) -> tuple[object, ...]:
    """The checkpoint shards one of our parameters is loaded from (fused projections)."""
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        return ("q", "k", "v")
    if name.endswith("gate_up_proj.weight"):
        return (0, 1)
    return (None,)


def load_weights(model: CausalLM, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    loaded: set[tuple[str, object]] = set()
    mapper = getattr(model, "map_checkpoint_name", map_name)  # a family's own names
    for hf_name, tensor in iter_checkpoint(model_dir):
        mapped = mapper(hf_name)
        if mapped is None:
            continue
        name, shard = mapped
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied embeddings: the checkpoint may still store a copy
        param = params.get(name)
        if param is None:
            log.warning("checkpoint tensor %s has no parameter in the model; ignored", hf_name)
            continue
        loader = getattr(param, "weight_loader", copy_checked)
        try:
            loader(param, tensor, shard)
        except CheckpointError as exc:
            raise CheckpointError(f"tensor {hf_name} in {model_dir}: {exc}") from None
        loaded.add((name, shard))
    family_shards = getattr(model, "checkpoint_shards", None)  # a family's own fused params
    expected: set[tuple[str, object]] = set()
    for name in params:
        shards = (family_shards(name) if family_shards else None) or default_shards(name)
        expected |= {(name, s) for s in shards}
    missing = sorted(f"{n}{'' if s is None else f'[{s}]'}" for n, s in expected - loaded)
    if missing:
        raise CheckpointError(
            f"{model_dir}: the checkpoint lacks {len(missing)} tensors the model needs, "
            f"e.g. {missing[:5]}"
        )


def init_random(model: CausalLM, seed: int) -> None:
    """Seeded random weights (normal, std 0.02; norms 1) in the parameters' own shapes."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)


def build_model(
    model_dir: Path,
    *,
    tp: TPGroup,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    cfg: ArchConfig | None = None,
    kernels: Kernels | None = None,
) -> CausalLM:
    cfg = cfg or load_arch_config(model_dir)
    model_class = CausalLM
    if cfg.mla is not None:
        from service.model.deepseek import DeepseekLM

        model_class = DeepseekLM
    with torch.device(device):  # parameters are created where they will live
        model = model_class(cfg, tp, max_positions, kernels)
    if load_format == "random":
        init_random(model, seed)
    elif load_format == "auto":
        if cfg.quantization is not None:  # e.g. DeepSeek-V3's fp8 blocks with their scales
            raise CheckpointError(
                f"{model_dir}: {cfg.quantization}-quantized weights are not supported; convert "
                "the checkpoint to bf16 first (or use --load-format random for its shapes)"
            )
        load_weights(model, model_dir)
    else:
        raise CheckpointError(f"unknown load format {load_format!r}; use auto or random")
    for p in model.parameters():  # rotary tables stay float32 (buffers), routers too
        if not getattr(p, "keep_fp32", False):
            p.data = p.data.to(dtype)
    model = model.to(device).eval()
    if device.type == "cuda":
        # the float32 originals are free now but still cached by the allocator: hand them back,
        # or the KV budget (sized from the driver's free memory) and the capture memory figures
        # (driver-level deltas) both miss them
        torch.cuda.empty_cache()
    return model
