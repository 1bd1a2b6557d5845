"""The native ``/generate`` endpoint (SGLang-compatible): parse, validate, submit, answer.

Everything that looks at the body (JSON parsing, the schema, tokenizing, validating against the
engine's limits) runs in a worker thread, never on the event loop: a huge or hostile body never
stalls ``/health`` or other requests. Answers are whole (``_collect``) or server-sent events
(``_stream``); a client that goes away has its requests aborted within a poll interval.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from fastapi import Request
from pydantic import ValidationError

from service.api.errors import ApiError
from service.api.runtime import EngineRuntime, Handle, NotReady, QueueFull, StreamDelta
from service.api.schemas import GenerateRequest, SamplingParamsIn
from service.engine import GenerationOutput
from service.errors import RequestError
from service.sampling import SamplingError, SamplingParams

DISCONNECT_POLL_S = 0.1


@dataclass(frozen=True)
class Prepared:
    prompts: list[list[int]]
    params: list[SamplingParams]
    single: bool  # one prompt, answered as an object (else a list)
    stream: bool


def parse_json(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply to be a request") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the body is not valid JSON") from None


def validation_message(exc: ValidationError) -> str:
    first = exc.errors()[0]
    # union branches add their type names to the location; keep only field names
    loc = ".".join(
        str(p) for p in first.get("loc", ()) if not str(p)[:1].isupper() and "[" not in str(p)
    )
    return f"{loc or 'body'}: {first.get('msg', 'invalid value')}"


def check_text(text: str, where: str = "text") -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400, f"'{where}' contains a lone surrogate (invalid Unicode); send valid UTF-8 text"
        ) from None


def prepare(runtime: EngineRuntime, raw: bytes) -> Prepared:
    """The body to prompts and sampling parameters, or an :class:`ApiError` saying what to change.
    Runs in a worker thread."""
    try:
        return _prepare(runtime, raw)
    except RequestError as exc:
        raise ApiError(400, str(exc)) from None


def _prepare(runtime: EngineRuntime, raw: bytes) -> Prepared:
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object with 'text' or 'input_ids'")
    try:
        body = GenerateRequest.model_validate(data)
    except ValidationError as exc:
        raise ApiError(400, validation_message(exc)) from None
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "send exactly one of 'text' or 'input_ids'")
    engine = ready(runtime)
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        single = isinstance(body.text, str)
        if not texts:
            raise ApiError(400, "'text' is an empty list; send at least one prompt")
        runtime.check_prompt_count(len(texts))
        for t in texts:
            check_text(t)
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
        runtime.check_prompt_count(len(prompts))
    sp = body.sampling_params
    raw_params = sp if isinstance(sp, list) else [sp] * len(prompts)
    if len(raw_params) != len(prompts):
        raise ApiError(
            400, f"sampling_params has {len(raw_params)} entries for {len(prompts)} prompts"
        )
    try:
        default = SamplingParamsIn()
        params = [(p or default).to_params() for p in raw_params]
    except SamplingError as exc:
        raise ApiError(400, str(exc)) from None
    validate(runtime, prompts, params)
    return Prepared(prompts, params, single, body.stream)


def ready(runtime: EngineRuntime):
    try:
        return runtime.ready_engine()
    except NotReady as exc:
        raise ApiError.unavailable(str(exc)) from None


def validate(
    runtime: EngineRuntime, prompts: list[list[int]], params: list[SamplingParams]
) -> None:
    """Each prompt and its token limit against the engine's limits (400 naming the prompt)."""
    engine = ready(runtime)
    context = engine.resolved.context_length
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        where = f"prompt {i}: " if len(prompts) > 1 else ""
        try:
            engine.scheduler.validate(ids)
        except RequestError as exc:
            raise ApiError(400, where + str(exc)) from None
        if p.max_new_tokens > context:
            raise ApiError(
                400, f"{where}max_new_tokens {p.max_new_tokens} exceeds the context length "
                f"{context}; a request never generates past its context",
            )  # fmt: skip


def submit(
    runtime: EngineRuntime,
    prompts: list[list[int]],
    params: list[SamplingParams],
    stream: bool = False,
    probe: bool = False,
) -> list[Handle]:
    try:
        return runtime.submit(prompts, params, asyncio.get_running_loop(), stream, probe=probe)
    except (QueueFull, NotReady) as exc:
        raise ApiError.unavailable(str(exc)) from None
    except RequestError as exc:
        raise ApiError(400, str(exc)) from None


async def final_event(handle: Handle) -> tuple[str, object]:
    while True:
        kind, payload = await handle.events.get()
        if kind in ("done", "error"):
            return kind, payload


def as_json(out: GenerationOutput) -> dict:
    return {"text": out.text, "output_ids": out.output_ids, "meta_info": out.meta_info}


async def collect(
    runtime: EngineRuntime, handles: list[Handle], request: Request
) -> list[GenerationOutput] | None:
    """Every handle's final output, or None when the client went away (its requests are aborted
    within a poll interval: nothing runs for a reader who is gone)."""
    tasks = [asyncio.ensure_future(final_event(h)) for h in handles]
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
            if getattr(payload, "retryable", False):
                raise ApiError.unavailable(f"generation stopped: {payload}")
            raise ApiError(500, f"generation failed: {payload}")
        results.append(payload)
    return results


async def next_event(h: Handle) -> tuple[str, object] | None:
    """The handle's next event, or None when none came within the disconnect poll interval.
    An event already queued (the engine posts once per step) is taken without awaiting."""
    try:
        return h.events.get_nowait()
    except asyncio.QueueEmpty:
        pass
    try:
        async with asyncio.timeout(DISCONNECT_POLL_S):
            return await h.events.get()
    except TimeoutError:
        return None


async def events(runtime: EngineRuntime, handles: list[Handle], request: Request):
    """(index, handle, kind, payload) of every event of ``handles`` as it comes; aborts the rest
    when the client goes away or the consumer stops early."""
    pending = {h.rid: (i, h) for i, h in enumerate(handles)}
    try:
        if len(handles) == 1:  # the common case, without a task and a wait per token
            h = handles[0]
            while pending:
                event = await next_event(h)
                if event is None:
                    if await request.is_disconnected():
                        raise asyncio.CancelledError
                    continue
                if event[0] in ("done", "error"):
                    pending.pop(h.rid)
                yield 0, h, event[0], event[1]
            return
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
                if kind in ("done", "error"):
                    pending.pop(h.rid)
                yield i, h, kind, payload
    finally:
        for _, h in pending.values():  # client gone mid-stream: free the engine's resources
            runtime.abort(h.rid, "client disconnected")


async def stream(runtime: EngineRuntime, handles: list[Handle], request: Request, single: bool):
    """Server-sent events: one per step that added tokens, each with the cumulative ``text`` and
    ``output_ids`` so far and a short ``meta_info``; the last event of a prompt carries its full
    ``meta_info`` (finish reason, prefill graph records); then ``data: [DONE]``."""
    ids: dict[str, list[int]] = {h.rid: [] for h in handles}
    texts: dict[str, str] = {h.rid: "" for h in handles}
    async for i, h, kind, payload in events(runtime, handles, request):
        if kind == "error":
            chunk: dict = {"error": {"message": f"generation failed: {payload}"}}
        elif kind == "done":
            chunk = as_json(payload)
        else:
            delta: StreamDelta = payload  # type: ignore[assignment]
            ids[h.rid] += delta.token_ids
            texts[h.rid] += delta.text
            chunk = {
                "text": texts[h.rid],
                "output_ids": ids[h.rid],
                "meta_info": {"id": h.rid, "prompt_tokens": len(h.prompt_ids),
                              "completion_tokens": len(ids[h.rid])},
            }  # fmt: skip
        if not single or kind == "error":
            chunk["index"] = i
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
