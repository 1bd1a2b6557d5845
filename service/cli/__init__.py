"""`capture-service` command line: plan, generate, serve.

Heavy modules (torch, ray, fastapi) are imported inside the subcommand that needs them, so
`capture-service plan` starts in milliseconds on a machine without torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from service.cli.args import add_engine_arguments, add_graph_arguments, positive_float, positive_int
from service.errors import ServiceError


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
        help="require 'Authorization: Bearer KEY' on /generate, /health_generate and "
        "/server_info (default: $CAPTURE_SERVICE_API_KEY)",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model id of the OpenAI API (default: the --model folder's name, or builtin)",
    )
    serve.add_argument("--max-queued-requests", type=positive_int, default=256)
    serve.add_argument("--max-body-bytes", type=positive_int, default=8 << 20)
    serve.add_argument(
        "--body-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a request body may take to arrive before the request fails with 408 "
        "(default 30)",
    )
    serve.add_argument(
        "--restart-attempts",
        type=positive_int,
        default=3,
        help="rebuilds of a failed engine before the server exits non-zero (default 3)",
    )
    serve.add_argument(
        "--graceful-shutdown-timeout",
        type=positive_float,
        default=30.0,
        help="seconds SIGTERM/SIGINT let in-flight requests finish before they are aborted "
        "(default 30)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            from service.cli.plan import run_plan

            return run_plan(args)
        if args.command == "generate":
            from service.cli.generate import run_generate

            return run_generate(args)
        if args.command == "serve":
            from service.cli.serve import run_serve

            return run_serve(args)
    except ServiceError as exc:
        parser.exit(2, f"capture-service {args.command}: error: {exc}\n")
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
