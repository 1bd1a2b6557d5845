"""`capture-service` command line: plan, generate, serve.

Heavy modules (torch, ray, fastapi) are imported inside the subcommand that needs them, so
`capture-service plan` starts in milliseconds on a machine without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from service.buckets import (
    PREFILL_BACKENDS,
    BucketPlan,
    PlanError,
    ResolvedRequestPool,
    parse_bucket_values,
    resolve_plan,
)
from service.config import ATTENTION_BACKENDS, FLASHINFER_KERNELS

PLAN_DEFAULT_CONTEXT_LENGTH = 2048
PLAN_DEFAULT_MAX_RUNNING_REQUESTS = 8
PLAN_DEFAULT_CHUNKED_PREFILL = 8192


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
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
        default=PLAN_DEFAULT_CONTEXT_LENGTH if for_plan else None,
        help="per-request context length"
        + (f" (default {PLAN_DEFAULT_CONTEXT_LENGTH})" if for_plan else " (default: the model's)"),
    )
    p.add_argument(
        "--max-running-requests",
        type=positive_int,
        default=PLAN_DEFAULT_MAX_RUNNING_REQUESTS if for_plan else None,
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
        default=PLAN_DEFAULT_CHUNKED_PREFILL if for_plan else None,
        help="max prefill tokens per batch"
        + (f" (default {PLAN_DEFAULT_CHUNKED_PREFILL})" if for_plan else " (default: per device)"),
    )


def add_engine_arguments(p: argparse.ArgumentParser, default_executor: str = "auto") -> None:
    add_graph_arguments(p)
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: local)")
    p.add_argument(
        "--executor",
        choices=("auto", "ray", "local"),
        default=default_executor,
        help="ray: a Ray actor per rank; local: one rank in this process; auto: Ray for --tp > 1"
        f" (default: {default_executor})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="capture-service",
        description="Multi-rank prefill CUDA-graph capture service",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the resolved prefill bucket plan")
    add_graph_arguments(plan, for_plan=True)
    plan.add_argument("--json", action="store_true", help="print one JSON object")

    gen = sub.add_parser("generate", help="generate from token ids with the engine")
    add_engine_arguments(gen)
    gen.add_argument(
        "--prompt-ids",
        action="append",
        required=True,
        help="comma-separated token ids of one prompt; repeat for several prompts",
    )
    gen.add_argument("--max-new-tokens", type=positive_int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--json", action="store_true")

    serve = sub.add_parser("serve", help="serve the HTTP API")
    add_engine_arguments(serve, default_executor="ray")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("CAPTURE_SERVICE_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on /generate (default: $CAPTURE_SERVICE_API_KEY)",
    )
    serve.add_argument("--max-queued-requests", type=positive_int, default=256)
    serve.add_argument("--max-body-bytes", type=positive_int, default=8 << 20)
    return parser


def format_plan(plan: BucketPlan) -> str:
    lines = [
        f"backend: {plan.backend}",
        f"context_length: {plan.context_length}",
        f"capture_request_capacity: {plan.capture_request_capacity}",
        f"max_capture_tokens: {plan.max_capture_tokens}",
        "",
        f"{'bucket':>8}  {'requests':>8}  capture_seq_lens",
    ]
    for b in plan.buckets:
        lens = ",".join(str(n) for n in b.capture_seq_lens)
        lines.append(f"{b.num_tokens:>8}  {b.num_synthetic_requests:>8}  [{lens}]")
    if not plan.buckets:
        lines.append("    (none)")
    if plan.dropped:
        lines += ["", "dropped:"]
        lines += [f"{d.num_tokens:>8}  {d.reason}" for d in plan.dropped]
    if plan.disabled_reason:
        lines += ["", f"disabled: {plan.disabled_reason}"]
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    plan = resolve_plan(
        backend=args.backend,
        context_length=args.context_length,
        pool=ResolvedRequestPool(args.max_running_requests),
        max_prefill_tokens=args.chunked_prefill_size,
        buckets=args.prefill_buckets,
        full_request_slots=args.full_request_slots,
        max_padding_fraction=args.max_padding_fraction,
    )
    print(json.dumps(plan.to_json()) if args.json else format_plan(plan))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            return run_plan(args)
        if args.command == "generate":
            from service.generate_cli import run_generate

            return run_generate(args)
        if args.command == "serve":
            from service.api.serve import run_serve

            return run_serve(args)
    except PlanError as exc:
        parser.exit(2, f"capture-service {args.command}: error: {exc}\n")
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
