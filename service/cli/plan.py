"""`capture-service plan`: the resolved prefill bucket plan for given sizes, without loading."""

from __future__ import annotations

import argparse
import json

from service.buckets import BucketPlan, ResolvedRequestPool
from service.cli.args import graph_config_from_args


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
    plan = graph_config_from_args(args).plan(
        context_length=args.context_length,
        pool=ResolvedRequestPool(args.max_running_requests),
        max_prefill_tokens=args.chunked_prefill_size,
    )
    print(json.dumps(plan.to_json()) if args.json else format_plan(plan))
    return 0
