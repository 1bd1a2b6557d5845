"""`capture-service plan`: the resolved prefill bucket plan for given sizes, without loading."""

from __future__ import annotations

import argparse
import json

from service.buckets import BucketPlan, ResolvedRequestPool
from service.cli.args import (
    PLAN_DEFAULT_CONTEXT_LENGTH,
    PLAN_DEFAULT_MAX_RUNNING_REQUESTS,
    graph_config_from_args,
)
from service.config import (
    DEFAULT_CHUNKED_PREFILL_CPU,
    DEFAULT_CHUNKED_PREFILL_CUDA,
    DEFAULT_CONTEXT_LENGTH_CAP,
    DEFAULT_MAX_RUNNING_REQUESTS_CAP,
)


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


def assumed_defaults(args: argparse.Namespace) -> dict[str, str]:
    """The sizes ``plan`` took by default, and what ``serve`` would take instead."""
    out = {}
    if args.context_length_default:
        out["context_length"] = (
            f"{args.context_length} (serve: the model's max_position_embeddings, capped at "
            f"{DEFAULT_CONTEXT_LENGTH_CAP})"
        )
    if args.max_running_requests_default:
        out["max_running_requests"] = (
            f"{args.max_running_requests} (serve: as many full contexts as the KV cache holds, "
            f"at most {DEFAULT_MAX_RUNNING_REQUESTS_CAP})"
        )
    if args.chunked_prefill_default:
        out["chunked_prefill_size"] = (
            f"{args.chunked_prefill_size} (the {args.device} default; --device "
            f"{'cpu' if args.device == 'cuda' else 'cuda'} for the other)"
        )
    return out


def run_plan(args: argparse.Namespace) -> int:
    args.context_length_default = args.context_length is None
    args.max_running_requests_default = args.max_running_requests is None
    args.chunked_prefill_default = args.chunked_prefill_size is None
    args.context_length = args.context_length or PLAN_DEFAULT_CONTEXT_LENGTH
    args.max_running_requests = args.max_running_requests or PLAN_DEFAULT_MAX_RUNNING_REQUESTS
    if args.chunked_prefill_size is None:
        args.chunked_prefill_size = (
            DEFAULT_CHUNKED_PREFILL_CUDA if args.device == "cuda" else DEFAULT_CHUNKED_PREFILL_CPU
        )
    plan = graph_config_from_args(args).plan(
        context_length=args.context_length,
        pool=ResolvedRequestPool(args.max_running_requests),
        max_prefill_tokens=args.chunked_prefill_size,
    )
    assumed = assumed_defaults(args)
    if args.json:
        print(json.dumps({**plan.to_json(), "assumed_defaults": assumed}))
    else:
        text = format_plan(plan)
        if assumed:
            text += "\n\nassumed defaults (give the value to plan for a given server):\n"
            text += "\n".join(f"  {k}: {v}" for k, v in assumed.items())
        print(text)
    return 0
