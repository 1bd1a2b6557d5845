"""The FastAPI app: /generate, /health, /health_generate, /server_info, /metrics.

Bad input gets a 4xx whose message says what to change, and loses nothing: the engine thread
never sees a request that failed validation, and a client that goes away has its request
aborted (its row and KV slots freed).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from service.api.runtime import EngineRuntime, NotReady, QueueFull
from service.api.schemas import GenerateRequest, SamplingParamsIn
from service.engine import GenerationOutput
from service.errors import RequestError
from service.sampling import SamplingError, SamplingParams

log = logging.getLogger("service.api")

DISCONNECT_POLL_S = 0.1
RETRY_AFTER_S = "1"
HEALTH_GENERATE_TIMEOUT_S = 60.0
PROTECTED = ("/generate", "/health_generate", "/server_info")


@dataclass(frozen=True)
class ApiSettings:
    api_key: str | None = None
    max_body_bytes: int = 8 << 20


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": status, "message": message}}, status_code=status, headers=headers
    )


def create_app(runtime: EngineRuntime, settings: ApiSettings) -> FastAPI:
    app = FastAPI(title="capture-service", version="0.1.0")

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.url.path in PROTECTED and settings.api_key is not None:
            auth = request.headers.get("authorization", "")
            given = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
            if not given or not hmac.compare_digest(given, settings.api_key):
                return error_response(
                    401, "missing or wrong API key; send 'Authorization: Bearer <key>'"
                )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return error_response(
                413, f"body of {length} bytes exceeds the limit of {settings.max_body_bytes}"
            )
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(400, "the body is not valid JSON")
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{loc or 'body'}: {first.get('msg', 'invalid value')}")

    @app.get("/health")
    async def health():
        reason = runtime.health()
        if reason is not None:
            return error_response(503, reason, {"Retry-After": RETRY_AFTER_S})
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        (handle,) = _submit(runtime, [[0]], [SamplingParams(max_new_tokens=1, temperature=0.0)])
        try:
            kind, payload = await asyncio.wait_for(
                _final_event(handle), timeout=HEALTH_GENERATE_TIMEOUT_S
            )
        except TimeoutError:
            runtime.abort(handle.rid, "health_generate timed out")
            return error_response(503, "a one-token generation did not finish in time")
        if kind == "error":
            return error_response(503, str(payload))
        return {"status": "ok", "output_ids": payload.output_ids}

    @app.get("/server_info")
    async def server_info():
        try:
            engine = runtime.ready_engine()
        except NotReady as exc:
            return error_response(503, str(exc), {"Retry-After": RETRY_AFTER_S})
        return {**engine.resolved.to_json(), "max_queued_requests": runtime.max_queued_requests}

    @app.get("/metrics")
    async def metrics():
        return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/generate")
    async def generate(request: Request):
        body = await _parse_body(request)
        prompts, params, single = _normalize(runtime, body)
        handles = _submit(runtime, prompts, params, stream=body.stream)
        if body.stream:
            return StreamingResponse(
                _stream(runtime, handles, request, single), media_type="text/event-stream"
            )
        results = await _collect(runtime, handles, request)
        if results is None:
            return Response(status_code=499)
        return results[0] if single else results

    return app


async def _parse_body(request: Request) -> GenerateRequest:
    """JSON whatever the content type (curl -d sends form-encoded headers), then the schema."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object with 'text' or 'input_ids'")
    try:
        return GenerateRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        # union branches add their type names to the location; keep only field names
        loc = ".".join(
            str(p) for p in first.get("loc", ()) if not str(p)[:1].isupper() and "[" not in str(p)
        )
        raise ApiError(400, f"{loc or 'body'}: {first.get('msg', 'invalid value')}") from None


def _normalize(
    runtime: EngineRuntime, body: GenerateRequest
) -> tuple[list[list[int]], list[SamplingParams], bool]:
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "send exactly one of 'text' or 'input_ids'")
    try:
        engine = runtime.ready_engine()
    except NotReady as exc:
        raise ApiError(503, str(exc), {"Retry-After": RETRY_AFTER_S}) from None
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        single = isinstance(body.text, str)
        if not texts:
            raise ApiError(400, "'text' is an empty list; send at least one prompt")
        try:
            prompts = [engine.encode(t) for t in texts]
        except RequestError as exc:
            raise ApiError(400, str(exc)) from None
    else:
        ids = body.input_ids
        single = bool(ids) and isinstance(ids[0], int)
        prompts = [list(ids)] if single else [list(p) for p in ids]
        if not prompts:
            raise ApiError(400, "'input_ids' is empty; send at least one token")
    sp = body.sampling_params
    raw = sp if isinstance(sp, list) else [sp] * len(prompts)
    if len(raw) != len(prompts):
        raise ApiError(400, f"sampling_params has {len(raw)} entries for {len(prompts)} prompts")
    try:
        default = SamplingParamsIn()
        params = [(p or default).to_params() for p in raw]
    except SamplingError as exc:
        raise ApiError(400, str(exc)) from None
    for i, ids in enumerate(prompts):
        try:
            engine.scheduler.validate(ids)
        except RequestError as exc:
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise ApiError(400, where + str(exc)) from None
    return prompts, params, single


def _submit(
    runtime: EngineRuntime,
    prompts: list[list[int]],
    params: list[SamplingParams],
    stream: bool = False,
):
    try:
        return runtime.submit(prompts, params, asyncio.get_running_loop(), stream)
    except QueueFull as exc:
        raise ApiError(503, str(exc), {"Retry-After": RETRY_AFTER_S}) from None
    except NotReady as exc:
        raise ApiError(503, str(exc), {"Retry-After": RETRY_AFTER_S}) from None
    except RequestError as exc:
        raise ApiError(400, str(exc)) from None


async def _final_event(handle) -> tuple[str, object]:
    while True:
        kind, payload = await handle.events.get()
        if kind in ("done", "error"):
            return kind, payload


def _as_json(out: GenerationOutput) -> dict:
    return {"text": out.text, "output_ids": out.output_ids, "meta_info": out.meta_info}


async def _collect(runtime: EngineRuntime, handles: list, request: Request) -> list | None:
    tasks = [asyncio.ensure_future(_final_event(h)) for h in handles]
    try:
        while True:
            done, _ = await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S)
            if len(done) == len(tasks):
                break
            if await request.is_disconnected():
                for h in handles:
                    runtime.abort(h.rid, "client disconnected")
                return None
    finally:
        for t in tasks:
            t.cancel()
    results = []
    for t in tasks:
        kind, payload = t.result()
        if kind == "error":
            raise ApiError(500, f"generation failed: {payload}")
        results.append(_as_json(payload))
    return results


async def _stream(runtime: EngineRuntime, handles: list, request: Request, single: bool):
    """Server-sent events: one per step that added tokens, each with the cumulative ``text`` and
    ``output_ids`` so far and a short ``meta_info``; the last event of a prompt carries its full
    ``meta_info`` (finish reason, prefill graph records); then ``data: [DONE]``."""
    pending = {h.rid: (i, h) for i, h in enumerate(handles)}
    ids: dict[str, list[int]] = {h.rid: [] for h in handles}
    texts: dict[str, str] = {h.rid: "" for h in handles}
    try:
        while pending:
            getters = {asyncio.ensure_future(h.events.get()): (i, h) for i, h in pending.values()}
            done, rest = await asyncio.wait(
                getters, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_COMPLETED
            )
            for t in rest:
                t.cancel()
            if not done and await request.is_disconnected():
                raise asyncio.CancelledError
            for t in done:
                i, h = getters[t]
                kind, payload = t.result()
                if kind == "error":
                    msg = {"error": {"message": f"generation failed: {payload}"}, "index": i}
                    yield f"data: {json.dumps(msg)}\n\n"
                    pending.pop(h.rid)
                    continue
                if kind == "done":
                    chunk = _as_json(payload)
                    pending.pop(h.rid)
                else:
                    ids[h.rid] += payload.token_ids
                    texts[h.rid] += payload.text
                    chunk = {
                        "text": texts[h.rid],
                        "output_ids": ids[h.rid],
                        "meta_info": {"id": h.rid, "prompt_tokens": len(h.prompt_ids),
                                      "completion_tokens": len(ids[h.rid])},
                    }  # fmt: skip
                if not single:
                    chunk["index"] = i
                yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for _, h in pending.values():  # client gone mid-stream: free the engine's resources
            runtime.abort(h.rid, "client disconnected")
