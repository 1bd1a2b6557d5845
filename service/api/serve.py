"""The HTTP server: uvicorn over the FastAPI app and the engine's loop thread.

The HTTP port opens at once; `/health` answers 503 while the model loads and graphs capture,
then 200. SIGTERM stops accepting connections and lets in-flight requests finish (up to the
graceful-shutdown timeout) before the ranks are shut down.
"""

from __future__ import annotations

import logging
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass

from service.api.app import ApiSettings
from service.config import EngineConfig

SWITCH_INTERVAL_S = 0.001


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 30000
    max_queued_requests: int = 256
    graceful_shutdown_timeout_s: float = 30.0


def build_app(cfg: EngineConfig, settings: ApiSettings, options: ServeOptions):
    from fastapi import FastAPI

    from service.api.app import create_app
    from service.api.metrics import Metrics
    from service.api.runtime import EngineRuntime
    from service.engine import Engine

    runtime = EngineRuntime(
        lambda: Engine(cfg), Metrics(), max_queued_requests=options.max_queued_requests
    )
    app: FastAPI = create_app(runtime, settings)

    @asynccontextmanager
    async def lifespan(_app):
        runtime.start()
        yield
        runtime.stop()

    app.router.lifespan_context = lifespan
    return app, runtime


def serve(cfg: EngineConfig, settings: ApiSettings, options: ServeOptions) -> int:
    import uvicorn

    from service.logs import setup_logging

    setup_logging(logging.INFO)
    # The engine loop and the HTTP event loop are two threads of one process. When a step's
    # device work ends, the engine thread waits for the interpreter lock while the event loop
    # streams; Python hands the lock over every switch interval (5 ms by default), which would
    # add up to 5 ms to every step under load. 1 ms bounds that wait.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app, _ = build_app(cfg, settings, options)
    logging.getLogger("service.api").info("Serving on http://%s:%d", options.host, options.port)
    uvicorn.run(
        app,
        host=options.host,
        port=options.port,
        log_level="warning",
        timeout_graceful_shutdown=int(options.graceful_shutdown_timeout_s),
    )
    return 0
