"""Start-up of one rank: resolve its device, model shard, KV pools and attention kernels.

Returns a typed :class:`RankSetup`; the :class:`~service.ranks.worker.RankWorker` built from it
plans, captures and executes. Nothing here must agree across ranks: each rank resolves from its
own device and memory, and the coordinator agrees afterwards (service.rank_info).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from service.config import DEFAULT_MAX_RUNNING_REQUESTS_CAP, EngineConfig
from service.model.arch_config import load_arch_config
from service.model.builtin import builtin_model_dir
from service.model.gate_up_tiles import shape_blocker
from service.model.kernels import FlashInferKernels, Kernels
from service.model.llama import CausalLM
from service.model.loader import build_model
from service.model.parallel import TPGroup
from service.rank_info import BackendChoice, RankInfo
from service.ranks import flashinfer_toolchain, triton_toolchain
from service.ranks.attention.base import AttentionBackend
from service.ranks.device import (
    resolve_chunked_prefill,
    resolve_context_length,
    resolve_device,
    resolve_dtype,
    resolve_kv_budget,
)
from service.ranks.kv_pool import (
    KVLayout,
    ReqToTokenPool,
    TokenKVPool,
    kv_slots_for_budget,
    resolve_max_running_requests,
)
from service.ranks.select import (
    choose_attention,
    choose_gate_up,
    choose_kernels,
    choose_prefill_schedule,
    choose_rope_store,
    choose_splitk_norm,
    flashinfer_import_error,
    float32_bmm_error,
    triton_import_error,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSetup:
    """Everything a rank resolved and built at start-up."""

    cfg: EngineConfig
    tp: TPGroup
    device: torch.device
    dtype: torch.dtype
    model: CausalLM
    kv: TokenKVPool
    req_to_token: ReqToTokenPool
    eager_attention: AttentionBackend  # attention of eager forwards and between segment replays
    graph_attention: AttentionBackend  # graph-safe attention captured inside `full` graphs
    decode_attention: AttentionBackend  # graph-safe decode attention captured in decode graphs
    info: RankInfo


def warn_by_name(choice: BackendChoice, missing: str | None) -> None:
    """A kernel taken by name (FlashInfer's, or a Triton one) although what it needs at run time
    is missing (``missing``: its toolchain's blocker, which would have kept ``auto`` on torch):
    say so before its first launch, where a kernel its library's cache lacks fails the start-up.
    """
    if choice.name != "torch" and missing is not None:
        log.warning("%s was asked for by name, but %s", choice.name, missing)


def model_dir_of(cfg: EngineConfig) -> Path:
    return Path(cfg.model_path) if cfg.model_path else builtin_model_dir()


def set_up_rank(cfg: EngineConfig, tp: TPGroup | None = None, local_gpu: int = 0) -> RankSetup:
    tp = tp or TPGroup()
    model_dir = model_dir_of(cfg)
    arch = load_arch_config(model_dir)
    device = resolve_device(cfg, local_gpu)
    dtype = resolve_dtype(cfg, arch, device)
    context_length = resolve_context_length(cfg, arch)
    chunked_prefill_size = resolve_chunked_prefill(cfg, device)
    dtype_name = str(dtype).removeprefix("torch.")
    wants_flashinfer = device.type == "cuda" and "flashinfer" in (
        cfg.attention_backend.replace("auto", "flashinfer"),
        cfg.fused_kernels.replace("auto", "flashinfer"),
    )
    fi_error = flashinfer_import_error() if wants_flashinfer else None
    # where its kernels would come from: prebuilt, or nvcc on first use (neither: auto serves
    # on torch rather than fail at the first kernel)
    fi_source = flashinfer_toolchain.find() if wants_flashinfer and fi_error is None else None
    fi_missing = None if fi_source is None else flashinfer_toolchain.blocker(fi_source)
    # DeepSeek's rotary is its own (interleaved pairs); the fused norm and SiLU kernels serve it
    kernel_dim = arch.head_dim if arch.mla is None else arch.mla.qk_rope_head_dim
    kernels = choose_kernels(
        cfg.fused_kernels, device.type, dtype_name, kernel_dim, fi_error, fi_source
    )
    log.info("Fused kernels: %s (%s)", kernels.name, kernels.reason)
    warn_by_name(kernels, fi_missing)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    # one import attempt for the Triton kernels' choices (a choice of "torch" never reads it)
    wants_triton = device.type == "cuda" and any(
        k != "torch" for k in (cfg.gate_up_kernel, cfg.rope_store_kernel, cfg.splitk_norm_kernel)
    )
    triton_error = triton_import_error() if wants_triton else None
    # Triton builds each kernel's launcher with a C compiler on first use: without one, auto
    # keeps the torch path rather than fail at the first Triton kernel
    triton_build = (
        triton_toolchain.blocker(triton_toolchain.find())
        if wants_triton and triton_error is None
        else None
    )
    gate_up = choose_gate_up(
        cfg.gate_up_kernel,
        device.type,
        dtype_name,
        capability,
        triton_error,
        # the dense MLP's shard (DeepSeek's shared experts, narrower, fall back per call)
        shape_blocker(arch.hidden_size, arch.intermediate_size // tp.world_size, dtype.itemsize),
        triton_build,
    )
    log.info("gate_up kernel: %s (%s)", gate_up.name, gate_up.reason)
    warn_by_name(gate_up, triton_build)
    rope_store = choose_rope_store(
        cfg.rope_store_kernel,
        device.type,
        dtype_name,
        arch.head_dim,
        kernels.name,
        triton_error,
        mla=arch.mla is not None,
        build_error=triton_build,
    )
    log.info("rope_store kernel: %s (%s)", rope_store.name, rope_store.reason)
    warn_by_name(rope_store, triton_build)
    splitk_norm = choose_splitk_norm(
        cfg.splitk_norm_kernel,
        device.type,
        dtype_name,
        capability,
        tp.world_size,
        triton_error,
        triton_build,
        float32_bmm_error(torch.ops.aten.bmm.overloads(), torch.__version__),
    )
    log.info("splitk_norm kernel: %s (%s)", splitk_norm.name, splitk_norm.reason)
    warn_by_name(splitk_norm, triton_build)
    model = build_model(
        model_dir,
        tp=tp,
        max_positions=max(context_length, 1),
        dtype=dtype,
        device=device,
        load_format=cfg.load_format,
        seed=cfg.seed,
        cfg=arch,
        kernels=make_kernels(
            kernels.name,
            fused_gate_up=gate_up.name == "triton",
            rope_store=rope_store.name == "triton",
            splitk_norm=splitk_norm.name == "triton",
        ),
    )
    parts, kv_heads, kv_dim = model.kv_entry()
    layout = KVLayout(
        num_layers=arch.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_dim=kv_dim,
        dtype=dtype,
        parts=parts,
    )
    num_slots = kv_slots_for_budget(layout, resolve_kv_budget(cfg, device))
    max_running_requests = resolve_max_running_requests(
        cfg.max_running_requests, num_slots, context_length, DEFAULT_MAX_RUNNING_REQUESTS_CAP
    )
    kv = TokenKVPool(layout, num_slots, device)
    req_to_token = ReqToTokenPool(max_running_requests, context_length, device)
    choice = choose_attention(
        cfg.attention_backend, device.type, dtype_name, arch.head_dim, fi_error,
        mla=None if arch.mla is None else (arch.mla.kv_lora_rank, arch.mla.qk_rope_head_dim),
        source=fi_source,
    )  # fmt: skip
    log.info("Attention backend: %s (%s)", choice.name, choice.reason)
    warn_by_name(choice, fi_missing)
    if arch.mla is not None and cfg.graph.backend == "full":
        log.warning(
            "Prefill backend full with MLA: its graph-safe attention is the torch slot "
            "attention, several times slower than eager prefill for MLA (docs/benchmarks.md); "
            "use --prefill-backend breakable"
        )
    schedule = choose_prefill_schedule(
        cfg.prefill_schedule, choice.name, cfg.flashinfer_kernel, capability,
        arch.mla is not None, cfg.graph.backend, lambda: _device_rewrite_error(device),
    )  # fmt: skip
    log.info("Prefill schedule: %s (%s)", schedule.name, schedule.reason)
    eager, graph, decode = attention_backends(
        choice, cfg, model, kv, req_to_token, balanced=schedule.name == "balanced"
    )
    info = RankInfo(
        rank=tp.rank,
        device=str(device),
        dtype=dtype_name,
        context_length=context_length,
        max_running_requests=max_running_requests,
        num_kv_slots=num_slots,
        chunked_prefill_size=chunked_prefill_size,
        vocab_size=arch.vocab_size,
        eos_token_ids=arch.eos_token_ids,
        model_dir=str(model_dir),
        architecture=arch.architecture,
        attention=choice,
        kernels=kernels,
        gate_up=gate_up,
        rope_store=rope_store,
        splitk_norm=splitk_norm,
        prefill_schedule=schedule,
    )
    return RankSetup(cfg, tp, device, dtype, model, kv, req_to_token, eager, graph, decode, info)


def _device_rewrite_error(device: torch.device) -> str | None:
    """The balanced schedule's start-up probe (CUDA only: select asks where FA3 runs)."""
    from service.ranks.attention.sm90_schedule import device_rewrite_error

    ctas = torch.cuda.get_device_properties(device).multi_processor_count
    return device_rewrite_error(device, ctas)


def make_kernels(
    name: str, fused_gate_up: bool = False, rope_store: bool = False, splitk_norm: bool = False
) -> Kernels:
    kernels = FlashInferKernels() if name == "flashinfer" else Kernels()
    if fused_gate_up:
        kernels.use_fused_gate_up()
    if rope_store:
        kernels.use_rope_store()
    if splitk_norm:
        kernels.use_splitk_norm()
    return kernels


def attention_backends(
    choice: BackendChoice,
    cfg: EngineConfig,
    model: CausalLM,
    kv: TokenKVPool,
    req_to_token: ReqToTokenPool,
    balanced: bool = False,
) -> tuple[AttentionBackend, AttentionBackend, AttentionBackend]:
    """(eager attention, graph-safe attention of the ``full`` backend, graph-safe decode
    attention) for the choice; ``balanced``: FA3 prefill plans are dealt again (sm90_balance)."""
    args = (model.registry, kv, req_to_token)
    mla = model.cfg.mla
    if choice.name == "flashinfer" and mla is None:
        from service.ranks.attention.flashinfer_backend import (
            FlashInferAttention,
            FlashInferGraphAttention,
        )
        from service.ranks.attention.flashinfer_decode import FlashInferDecodeGraphAttention

        eager = FlashInferAttention(*args, kernel=cfg.flashinfer_kernel, balanced=balanced)
        shared = {"kernel": cfg.flashinfer_kernel, "workspace": eager.workspace}
        # full's: the schedule's device rewrite captured in its graphs (graph_prologue)
        graph = FlashInferGraphAttention(*args, **shared, balanced=balanced, balance_in_graph=True)
        decode = FlashInferDecodeGraphAttention(*args, max_size=req_to_token.num_rows, **shared)
        return eager, graph, decode
    from service.ranks.attention.torch_decode import TorchDecodeAttention
    from service.ranks.attention.torch_slots import TorchSlotAttention
    from service.ranks.attention.torch_varlen import TorchVarlenAttention

    decode_graphs: AttentionBackend = TorchDecodeAttention(*args)
    if choice.name == "flashinfer" and mla is not None:  # MLA: FlashInfer for decode graphs only
        from service.ranks.attention.flashinfer_mla import FlashInferMlaDecodeAttention

        decode_graphs = FlashInferMlaDecodeAttention(
            *args, kv_lora_rank=mla.kv_lora_rank, max_size=req_to_token.num_rows,
            kernel=cfg.flashinfer_kernel,
        )  # fmt: skip
    return TorchVarlenAttention(*args), TorchSlotAttention(*args), decode_graphs
