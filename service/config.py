"""User-facing configuration: frozen dataclasses, no torch import.

``None`` means "resolve at start-up" (from the model, the device or the KV capacity). Resolved
values never go back into these objects: they live in :class:`service.resolved.ResolvedConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from service.buckets import (
    PREFILL_BACKENDS,
    BucketPlan,
    PrefillBackend,
    ResolvedRequestPool,
    resolve_plan,
)
from service.decode_sizes import DecodePlan, resolve_decode_plan
from service.errors import ConfigError

LoadFormat = Literal["auto", "random"]
Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
AttentionName = Literal["auto", "flashinfer", "torch"]
FlashInferKernel = Literal["auto", "fa2", "fa3"]
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "flashinfer", "torch")
FLASHINFER_KERNELS: tuple[str, ...] = ("auto", "fa2", "fa3")
GateUpName = Literal["auto", "triton", "torch"]
GATE_UP_KERNELS: tuple[str, ...] = ("auto", "triton", "torch")
ROPE_STORE_KERNELS: tuple[str, ...] = GATE_UP_KERNELS  # the same three choices
SPLITK_NORM_KERNELS: tuple[str, ...] = GATE_UP_KERNELS
ScheduleName = Literal["auto", "balanced", "own"]
PREFILL_SCHEDULES: tuple[str, ...] = ("auto", "balanced", "own")

DEFAULT_CONTEXT_LENGTH_CAP = 4096  # used when the model allows more and the user sets nothing
DEFAULT_CHUNKED_PREFILL_CPU = 2048
DEFAULT_CHUNKED_PREFILL_CUDA = 8192
DEFAULT_MAX_RUNNING_REQUESTS_CAP = 64
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0  # torch.distributed's own bound on one collective
DEFAULT_STARTUP_TIMEOUT_S = 1200.0  # load, plan and capture of every rank (big checkpoints)
DEFAULT_STEP_TIMEOUT_S = 30.0  # one forward on every rank; well under the collective timeout


@dataclass(frozen=True)
class GraphConfig:
    """How prefill graphs are captured."""

    backend: PrefillBackend = "breakable"
    buckets: tuple[int, ...] | None = None  # None: service.buckets.default_prefill_buckets
    full_request_slots: int | None = None  # None: DEFAULT_FULL_REQUEST_SLOTS, capped by the pool
    max_padding_fraction: float = 1.0  # a hit may pad at most this share of its bucket

    def __post_init__(self) -> None:
        if self.backend not in PREFILL_BACKENDS:
            raise ConfigError(
                f"unsupported prefill backend {self.backend!r}; supported: {list(PREFILL_BACKENDS)}"
            )

    def plan(
        self, *, context_length: int, pool: ResolvedRequestPool, max_prefill_tokens: int
    ) -> BucketPlan:
        """The one mapping from this configuration to a rank's legal bucket plan (the rank
        worker and ``capture-service plan`` both call it)."""
        return resolve_plan(
            backend=self.backend,
            context_length=context_length,
            pool=pool,
            max_prefill_tokens=max_prefill_tokens,
            buckets=self.buckets,
            full_request_slots=self.full_request_slots,
            max_padding_fraction=self.max_padding_fraction,
        )


@dataclass(frozen=True)
class DecodeGraphConfig:
    """How decode steps are captured (service.decode_sizes)."""

    # None ("auto"): on where CUDA graphs exist; on CPU the recorded graphs are slower than an
    # eager decode (they read every request's whole context row), so they run only when asked
    enabled: bool | None = None
    sizes: tuple[int, ...] | None = None  # None: service.decode_sizes.default_decode_sizes

    def plan(self, max_running_requests: int, device_type: str) -> DecodePlan:
        """The one mapping from this configuration to a rank's decode sizes."""
        enabled = self.enabled if self.enabled is not None else device_type == "cuda"
        if not enabled and self.enabled is None:
            return DecodePlan(
                (), max_running_requests,
                disabled_reason="decode graphs are off on CPU by default (--decode-graphs on)",
            )  # fmt: skip
        return resolve_decode_plan(
            enabled=enabled, max_running_requests=max_running_requests, sizes=self.sizes
        )


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (all of its ranks) needs to start."""

    model_path: str | None = None  # None: the built-in model
    load_format: LoadFormat = "auto"
    dtype: DType = "auto"
    device: Device = "auto"
    tp: int = 1
    context_length: int | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    kv_cache_memory_bytes: int | None = None  # None: a share of free device memory (CPU: 512 MiB)
    graph: GraphConfig = GraphConfig()
    decode: DecodeGraphConfig = DecodeGraphConfig()
    seed: int = 0
    ray_address: str | None = None  # None: start Ray locally
    # where ranks run: "ray" (an actor per rank), "local" (tp 1 in this process), or "auto"
    # (Ray when tp > 1 or a cluster address is given)
    executor: Literal["auto", "ray", "local"] = "auto"
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    # attention kernels: "auto" takes FlashInfer on CUDA when it is installed and supports the
    # model's head dim and dtype, else torch; see service.ranks.select
    attention_backend: AttentionName = "auto"
    flashinfer_kernel: FlashInferKernel = "auto"  # FlashInfer's own choice: fa3 on Hopper
    # the model's elementwise chains (RMSNorm + residual add, rotary, SiLU-and-mul): "auto" takes
    # FlashInfer's fused kernels where they run, else the torch reference
    fused_kernels: AttentionName = "auto"
    # the MLP's gate_up GEMM + SiLU-and-mul: "auto" takes one Triton kernel on sm90 where it is
    # faster than the pair (service.model.gate_up_tiles), else the projection then the activation
    gate_up_kernel: GateUpName = "auto"
    # rotary on q and k and the K/V store: "auto" takes one Triton kernel on CUDA with FlashInfer's
    # fused kernels (service.model.rope_store_triton), else the rotary kernel, then the store
    rope_store_kernel: GateUpName = "auto"
    # o_proj and down split over K, their partials summed by the add-RMSNorm that follows: "auto"
    # takes the Triton kernel on sm90 with one rank (service.model.splitk_policy says at which
    # token counts), else cuBLAS's projection, then the norm
    splitk_norm_kernel: GateUpName = "auto"
    # which SM runs which work item of FlashInfer's FA3 prefill kernel: "balanced" deals them
    # longest first across heads (service.ranks.attention.sm90_balance), "own" keeps FlashInfer's
    # schedule, "auto" deals again for the graph backends and keeps FlashInfer's for eager
    # (service.ranks.select.choose_prefill_schedule says why)
    prefill_schedule: ScheduleName = "auto"

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"unsupported attention backend {self.attention_backend!r}; "
                f"supported: {list(ATTENTION_BACKENDS)}"
            )
        if self.fused_kernels not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"unsupported fused kernels {self.fused_kernels!r}; "
                f"supported: {list(ATTENTION_BACKENDS)}"
            )
        if self.gate_up_kernel not in GATE_UP_KERNELS:
            raise ConfigError(
                f"unsupported gate_up kernel {self.gate_up_kernel!r}; "
                f"supported: {list(GATE_UP_KERNELS)}"
            )
        if self.rope_store_kernel not in ROPE_STORE_KERNELS:
            raise ConfigError(
                f"unsupported rope_store kernel {self.rope_store_kernel!r}; "
                f"supported: {list(ROPE_STORE_KERNELS)}"
            )
        if self.splitk_norm_kernel not in SPLITK_NORM_KERNELS:
            raise ConfigError(
                f"unsupported splitk_norm kernel {self.splitk_norm_kernel!r}; "
                f"supported: {list(SPLITK_NORM_KERNELS)}"
            )
        if self.prefill_schedule not in PREFILL_SCHEDULES:
            raise ConfigError(
                f"unsupported prefill schedule {self.prefill_schedule!r}; "
                f"supported: {list(PREFILL_SCHEDULES)}"
            )
        if self.flashinfer_kernel not in FLASHINFER_KERNELS:
            raise ConfigError(
                f"unsupported FlashInfer kernel {self.flashinfer_kernel!r}; "
                f"supported: {list(FLASHINFER_KERNELS)}"
            )
        for name in (
            "tp",
            "context_length",
            "max_running_requests",
            "chunked_prefill_size",
            "kv_cache_memory_bytes",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.executor == "local" and (self.tp > 1 or self.ray_address):
            raise ConfigError(
                "--executor local runs one rank in-process; use --executor ray for --tp > 1"
            )
        for name in ("collective_timeout_s", "startup_timeout_s", "step_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
