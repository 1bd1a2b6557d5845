"""`capture-service serve`: uvicorn over the FastAPI app and the engine's loop thread.

The HTTP port opens at once; `/health` answers 503 while the model loads and graphs capture,
then 200. SIGTERM stops accepting connections and lets in-flight requests finish (up to the
graceful-shutdown timeout) before the ranks are shut down.
"""

from __future__ import annotations

import argparse
import logging
from contextlib import asynccontextmanager

GRACEFUL_SHUTDOWN_S = 30


def build_app(args: argparse.Namespace):
    from fastapi import FastAPI

    from service.api.app import ApiSettings, create_app
    from service.api.metrics import Metrics
    from service.api.runtime import EngineRuntime
    from service.engine import Engine
    from service.generate_cli import engine_config_from_args

    cfg = engine_config_from_args(args)
    runtime = EngineRuntime(
        lambda: Engine(cfg), Metrics(), max_queued_requests=args.max_queued_requests
    )
    app: FastAPI = create_app(
        runtime, ApiSettings(api_key=args.api_key, max_body_bytes=args.max_body_bytes)
    )

    @asynccontextmanager
    async def lifespan(_app):
        runtime.start()
        yield
        runtime.stop()

    app.router.lifespan_context = lifespan
    return app, runtime


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.logs import setup_logging

    setup_logging(logging.INFO)
    app, _ = build_app(args)
    logging.getLogger("service.api").info("Serving on http://%s:%d", args.host, args.port)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return 0
