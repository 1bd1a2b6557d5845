"""The FastAPI app: /generate, /health, /health_generate, /server_info, /metrics.

Bad input gets a 4xx whose message says what to change, and loses nothing: the engine thread
never sees a request that failed validation, and a client that goes away has its request
aborted (its row and KV slots freed), streaming or not. The guard in front of every route
(service.api.guard) checks the API key and bounds the body's size and time.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from service import __version__
from service.api import generate as gen
from service.api.errors import ApiError, error_response
from service.api.guard import BodyRejected, Guard
from service.api.openai import add_openai_routes
from service.api.runtime import EngineRuntime
from service.sampling import SamplingParams

log = logging.getLogger("service.api")

HEALTH_GENERATE_TIMEOUT_S = 60.0
# paths that need the API key when one is set (the docs too: they describe the protected API)
PROTECTED = ("/generate", "/health_generate", "/server_info", "/v1", "/docs", "/redoc",
             "/openapi.json")  # fmt: skip


@dataclass(frozen=True)
class ApiSettings:
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    served_model_name: str = "builtin"  # the model id of the OpenAI API
    body_timeout_s: float = 30.0  # a body must arrive within this (slow or lying clients)


def create_app(runtime: EngineRuntime, settings: ApiSettings) -> FastAPI:
    app = FastAPI(title="capture-service", version=__version__)
    app.add_middleware(
        Guard,
        api_key=settings.api_key,
        protected=PROTECTED,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
    )

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.headers)

    @app.exception_handler(BodyRejected)
    async def body_rejected(_: Request, exc: BodyRejected):
        return error_response(exc.status, exc.message)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        # a bug, never a client's fault: logged with its trace, answered in the API's shape
        log.exception("Unhandled error: %s", exc)
        return error_response(500, f"internal error ({type(exc).__name__}); see the server log")

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(400, "the body is not valid JSON")
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{loc or 'body'}: {first.get('msg', 'invalid value')}")

    add_openai_routes(app, runtime, settings.served_model_name)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        reason = runtime.health()
        if reason is not None:
            return error_response(503, reason, {"Retry-After": "1"})
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        params = [SamplingParams(max_new_tokens=1, temperature=0.0)]
        (handle,) = gen.submit(runtime, [[0]], params, probe=True)
        try:
            kind, payload = await asyncio.wait_for(
                gen.final_event(handle), timeout=HEALTH_GENERATE_TIMEOUT_S
            )
        except TimeoutError:
            runtime.abort(handle.rid, "health_generate timed out")
            return error_response(503, "a one-token generation did not finish in time")
        if kind == "error":
            return error_response(503, str(payload))
        return {"status": "ok", "output_ids": payload.output_ids}

    @app.get("/server_info")
    async def server_info():
        engine = gen.ready(runtime)
        return {**engine.resolved.to_json(), "max_queued_requests": runtime.max_queued_requests}

    @app.get("/metrics")
    async def metrics():
        return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/generate")
    async def generate(request: Request):
        raw = await request.body()  # the guard bounds its size and the time it may take
        p = await asyncio.to_thread(gen.prepare, runtime, raw)
        handles = gen.submit(runtime, p.prompts, p.params, stream=p.stream)
        if p.stream:
            return StreamingResponse(
                gen.stream(runtime, handles, request, p.single), media_type="text/event-stream"
            )
        results = await gen.collect(runtime, handles, request)
        if results is None:
            return Response(status_code=499)
        answers = [gen.as_json(r) for r in results]
        return answers[0] if p.single else answers

    return app
