"""Command-line arguments shared by the subcommands, and their mapping to the frozen configs."""

from __future__ import annotations

import argparse

from service.buckets import PREFILL_BACKENDS, parse_bucket_values
from service.config import (
    ATTENTION_BACKENDS,
    DEFAULT_CHUNKED_PREFILL_CPU,
    DEFAULT_CHUNKED_PREFILL_CUDA,
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_STEP_TIMEOUT_S,
    FLASHINFER_KERNELS,
    GATE_UP_KERNELS,
    PREFILL_SCHEDULES,
    ROPE_STORE_KERNELS,
    SPLITK_NORM_KERNELS,
    DecodeGraphConfig,
    EngineConfig,
    GraphConfig,
)
from service.decode_sizes import parse_decode_sizes
from service.errors import PlanError

PLAN_DEFAULT_CONTEXT_LENGTH = 2048
PLAN_DEFAULT_MAX_RUNNING_REQUESTS = 8


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def bucket_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(parse_bucket_values(text))
    except PlanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be within [0, 1]")
    return value


def add_graph_arguments(p: argparse.ArgumentParser, *, for_plan: bool = False) -> None:
    p.add_argument(
        "--prefill-backend",
        "--backend",
        dest="backend",
        choices=PREFILL_BACKENDS,
        default="breakable",
        help="prefill graph backend (default: breakable)",
    )
    p.add_argument(
        "--prefill-buckets",
        type=bucket_list,
        default=None,
        help="comma-separated aggregate token counts to capture (default: the built-in list)",
    )
    p.add_argument(
        "--full-request-slots",
        type=positive_int,
        default=None,
        help="fixed request slots S of the full backend (default: min(8, max-running-requests))",
    )
    p.add_argument(
        "--max-padding-fraction",
        type=fraction,
        default=1.0,
        help="a batch replays a bucket only if padding is at most this share of it (default 1.0)",
    )
    p.add_argument(
        "--context-length",
        type=positive_int,
        default=None,
        help="per-request context length"
        + (f" (default {PLAN_DEFAULT_CONTEXT_LENGTH})" if for_plan else " (default: the model's)"),
    )
    p.add_argument(
        "--max-running-requests",
        type=positive_int,
        default=None,
        help="request pool size"
        + (
            f" (default {PLAN_DEFAULT_MAX_RUNNING_REQUESTS})"
            if for_plan
            else " (default: derived from KV cache capacity)"
        ),
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=positive_int,
        default=None,
        help="max prefill tokens per batch (default: per device, "
        f"{DEFAULT_CHUNKED_PREFILL_CUDA} on CUDA, {DEFAULT_CHUNKED_PREFILL_CPU} on CPU)",
    )
    if for_plan:
        p.add_argument(
            "--device",
            choices=("cuda", "cpu"),
            default="cuda",
            help="whose defaults to plan with where a size is not given (default cuda; serve "
            "on a CPU machine uses the cpu ones)",
        )


def decode_size_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(parse_decode_sizes(text))
    except PlanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_arguments(p: argparse.ArgumentParser, default_executor: str = "auto") -> None:
    add_graph_arguments(p)
    p.add_argument(
        "--decode-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="replay decode steps through graphs captured per decode batch size; auto (the "
        "default): on where CUDA graphs exist, off on CPU",
    )
    p.add_argument(
        "--decode-graph-sizes",
        type=decode_size_list,
        default=None,
        help="comma-separated decode batch sizes to capture (default: 1,2,4,8,12,16,24,32, "
        "then sparser up to the request pool size)",
    )
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: built-in)")
    p.add_argument("--load-format", choices=("auto", "random"), default="auto")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks")
    p.add_argument("--kv-cache-memory-bytes", type=positive_int, default=None)
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="auto: FlashInfer on CUDA when installed and the head dim is supported, else torch",
    )
    p.add_argument(
        "--flashinfer-kernel",
        choices=FLASHINFER_KERNELS,
        default="auto",
        help="FlashInfer prefill kernels: auto (FlashInfer's choice, fa3 on Hopper), fa2, fa3",
    )
    p.add_argument(
        "--prefill-schedule",
        choices=PREFILL_SCHEDULES,
        default="auto",
        help="which SM runs which work item of FlashInfer's FA3 prefill kernel: balanced "
        "(longest items first across heads, sm90), own (FlashInfer's); auto: balanced for the "
        "graph backends, own for eager (docs/benchmarks.md)",
    )
    p.add_argument(
        "--fused-kernels",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="RMSNorm+residual, rotary and SiLU-and-mul kernels: auto (FlashInfer's fused kernels "
        "on CUDA when installed, else torch), flashinfer, torch",
    )
    p.add_argument(
        "--gate-up-kernel",
        choices=GATE_UP_KERNELS,
        default="auto",
        help="the MLP's gate_up GEMM + SiLU-and-mul: auto (one Triton kernel on sm90 at the token "
        "counts where it is faster, else the pair), triton, torch (the pair)",
    )
    p.add_argument(
        "--rope-store-kernel",
        choices=ROPE_STORE_KERNELS,
        default="auto",
        help="rotary on q and k and the K/V store: auto (one Triton kernel on CUDA with "
        "FlashInfer's fused kernels, else the rotary kernel then the store), triton, torch",
    )
    p.add_argument(
        "--splitk-norm-kernel",
        choices=SPLITK_NORM_KERNELS,
        default="auto",
        help="o_proj and down split over K, summed by the add-RMSNorm after them: triton (a Triton "
        "kernel, CUDA with --tp 1, at the token counts where it measured faster), torch (cuBLAS's "
        "projection, then the norm), auto (triton on sm90 with --tp 1 and triton installed, else "
        "torch)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: local)")
    p.add_argument(
        "--executor",
        choices=("auto", "ray", "local"),
        default=default_executor,
        help="ray: a Ray actor per rank; local: one rank in this process; auto: Ray for --tp > 1"
        f" (default: {default_executor})",
    )
    p.add_argument(
        "--startup-timeout",
        type=positive_float,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        help="seconds every rank may take to load, plan and capture "
        f"(default {DEFAULT_STARTUP_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--step-timeout",
        type=positive_float,
        default=DEFAULT_STEP_TIMEOUT_S,
        help="seconds one forward may take on every rank before the engine is declared hung "
        f"(default {DEFAULT_STEP_TIMEOUT_S:g})",
    )


def graph_config_from_args(args: argparse.Namespace) -> GraphConfig:
    return GraphConfig(
        backend=args.backend,
        buckets=args.prefill_buckets,
        full_request_slots=args.full_request_slots,
        max_padding_fraction=args.max_padding_fraction,
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model_path=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        tp=args.tp,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        graph=graph_config_from_args(args),
        decode=DecodeGraphConfig(
            enabled={"auto": None, "on": True, "off": False}[args.decode_graphs],
            sizes=args.decode_graph_sizes,
        ),
        seed=args.seed,
        ray_address=args.ray_address,
        executor=args.executor,
        startup_timeout_s=args.startup_timeout,
        step_timeout_s=args.step_timeout,
        attention_backend=args.attention_backend,
        flashinfer_kernel=args.flashinfer_kernel,
        prefill_schedule=args.prefill_schedule,
        fused_kernels=args.fused_kernels,
        gate_up_kernel=args.gate_up_kernel,
        rope_store_kernel=args.rope_store_kernel,
        splitk_norm_kernel=args.splitk_norm_kernel,
    )
