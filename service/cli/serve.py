"""`capture-service serve`: map the arguments to configs and hand them to the HTTP server."""

from __future__ import annotations

import argparse
from pathlib import Path

from service.cli.args import engine_config_from_args


def run_serve(args: argparse.Namespace) -> int:
    from service.api.app import ApiSettings
    from service.api.serve import ServeOptions, serve

    return serve(
        engine_config_from_args(args),
        ApiSettings(
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.body_timeout,
            served_model_name=args.served_model_name
            or (Path(args.model).name if args.model else "builtin"),
        ),
        ServeOptions(
            host=args.host,
            port=args.port,
            max_queued_requests=args.max_queued_requests,
            graceful_shutdown_timeout_s=args.graceful_shutdown_timeout,
            restart_attempts=args.restart_attempts,
        ),
    )
