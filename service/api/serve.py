"""The HTTP server: uvicorn over the FastAPI app and the engine's loop thread.

The HTTP port opens at once; `/health` answers 503 while the model loads and graphs capture,
then 200. SIGTERM or SIGINT drains: new requests get 503 with Retry-After and `/health` says the
server is shutting down, in-flight requests finish (or are aborted at
``--graceful-shutdown-timeout``), then the server closes, stops its rank actors and any Ray
processes it started, and exits 0. A second signal exits at once. An engine that cannot start,
or cannot be rebuilt after a failure, exits non-zero so that an orchestrator restarts it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass

from service.api.app import ApiSettings
from service.config import EngineConfig
from service.executors import uses_ray

log = logging.getLogger("service.api")

# The engine loop and the HTTP event loop are two threads of one process. When a step's device
# work ends, the engine thread waits for the interpreter lock while the event loop streams;
# Python hands the lock over every switch interval (5 ms by default), which would add up to 5 ms
# to every step under load. 1 ms bounds that wait. CAPTURE_SERVICE_SWITCH_INTERVAL_S overrides it
# (benchmarks/gpu_run.sh measures the choice).
SWITCH_INTERVAL_S = 0.001


def switch_interval_s() -> float:
    raw = os.environ.get("CAPTURE_SERVICE_SWITCH_INTERVAL_S")
    if raw is None:
        return SWITCH_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 0.1:
        raise SystemExit(
            f"CAPTURE_SERVICE_SWITCH_INTERVAL_S={raw!r}: give seconds in (0, 0.1], e.g. 0.0005"
        )
    return value


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 30000
    max_queued_requests: int = 256
    graceful_shutdown_timeout_s: float = 30.0
    restart_attempts: int = 3


def build_app(cfg: EngineConfig, settings: ApiSettings, options: ServeOptions):
    from fastapi import FastAPI

    from service.api.app import create_app
    from service.api.metrics import Metrics
    from service.api.runtime import EngineRuntime
    from service.engine import Engine

    runtime = EngineRuntime(
        lambda: Engine(cfg),
        Metrics(),
        max_queued_requests=options.max_queued_requests,
        restart_attempts=options.restart_attempts,
        step_timeout_s=cfg.step_timeout_s,
    )
    app: FastAPI = create_app(runtime, settings)

    @asynccontextmanager
    async def lifespan(_app):
        runtime.start()
        yield
        runtime.stop()

    app.router.lifespan_context = lifespan
    return app, runtime


def _exit_now(message: str, code: int = 0) -> None:
    """Exit without Python's exit hooks: Ray's would wait on a GCS that was stopped or is gone."""
    log.info("%s", message)
    logging.shutdown()
    os._exit(code)


def serve(cfg: EngineConfig, settings: ApiSettings, options: ServeOptions) -> int:
    import uvicorn

    from service.logs import setup_logging

    setup_logging(logging.INFO)
    sys.setswitchinterval(switch_interval_s())
    log.info("Interpreter switch interval: %g s", sys.getswitchinterval())
    if uses_ray(cfg):
        # Ray's core worker installs its own SIGTERM/SIGINT handlers (which end the process at
        # once) when it connects: connect here, in the main thread, before uvicorn installs the
        # handlers that drain, so that theirs are replaced and ours stay.
        from service.executors.ray_start import RayStartInterrupted, start_ray, stop_started_ray

        log.info("Starting Ray (%s)", cfg.ray_address or "a new local instance")
        try:
            ray_started = start_ray(cfg.ray_address)
        except RayStartInterrupted as exc:
            _exit_now(f"{exc}; Server stopped (exit code 0)")
        except Exception as exc:
            log.error("start-up failed: cannot reach Ray (%s: %s)", type(exc).__name__, exc)
            return 1
        try:
            app, runtime = build_app(cfg, settings, options)
        except (SystemExit, KeyboardInterrupt):  # a signal before uvicorn's handlers are in
            ended = stop_started_ray()
            _exit_now(f"a signal arrived before the server started; stopped Ray ({ended} "
                      "processes left ended); Server stopped (exit code 0)")  # fmt: skip
        ray_started.hand_over()
    else:
        app, runtime = build_app(cfg, settings, options)

    class Server(uvicorn.Server):
        """uvicorn that drains before it closes, and exits non-zero on a fatal engine error."""

        exit_code = 0
        draining = False

        def handle_exit(self, sig: int, frame) -> None:
            if self.draining:  # a second signal: stop now
                super().handle_exit(sig, frame)
                return
            self.draining = True
            log.info("Signal %d: draining for up to %g s", sig, options.graceful_shutdown_timeout_s)
            runtime.begin_drain()
            threading.Thread(target=self._drain_then_exit, name="drain", daemon=True).start()

        def _drain_then_exit(self) -> None:
            runtime.drain(options.graceful_shutdown_timeout_s)
            self.should_exit = True

        def fatal(self, reason: str) -> None:
            log.error("Exiting: %s", reason)
            self.exit_code = 1
            self.should_exit = True

    server = Server(
        uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )
    runtime.on_fatal = server.fatal
    log.info("Serving on http://%s:%d", options.host, options.port)
    server.run()
    if uses_ray(cfg):  # the actors went with the engine; the Ray processes this server started
        from service.executors.ray import gcs_reachable

        if gcs_reachable():
            import ray

            ray.shutdown()
        else:  # Ray's own processes got the signal too; any Ray call (its atexit hook included)
            # would wait a minute for them
            log.warning("Ray's GCS is gone (signalled with this server?): skipping ray.shutdown()")
            _exit_now(f"Server stopped (exit code {server.exit_code})", server.exit_code)
    log.info("Server stopped (exit code %d)", server.exit_code)
    return server.exit_code
