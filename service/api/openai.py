"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

The same engine, limits, API key, body guard and abort-on-disconnect as ``/generate``
(service.api.generate). Answers follow OpenAI's shapes (the official client parses them); errors
are ``{"error": {"message", "type", "param", "code"}}`` with the matching status. Every answer
(and the last stream chunk of each choice) also carries ``capture_service``: the prefill batches
of the request with graph hit or miss, bucket and padding, and its decode steps; OpenAI clients
ignore the extra field.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from service.api import generate as gen
from service.api.errors import ApiError, error_response
from service.api.handles import Handle, StreamDelta
from service.api.openai_schemas import (
    ChatCompletionRequest,
    CommonFields,
    CompletionRequest,
    Unsupported,
)
from service.api.runtime import EngineRuntime
from service.commands import TokenLogprob
from service.engine import Engine, GenerationOutput
from service.errors import RequestError
from service.sampling import SamplingError, SamplingParams


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.headers, self.param)


@dataclass(frozen=True)
class Job:
    """One OpenAI request, prepared: its prompts and what to put in the answer."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    prompt_texts: list[str | None]  # for echo
    stream: bool
    include_usage: bool
    chat: bool


def _validated(model: type, raw: bytes):
    data = gen.parse_json(raw)
    if not isinstance(data, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    try:
        body = model.model_validate(data)
        body.check_supported()
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if not str(p)[:1].isupper())
        param = param.split(".")[0] if first.get("type") == "extra_forbidden" else param
        what = "is not supported" if first.get("type") == "extra_forbidden" else first["msg"]
        raise OpenAIError(400, f"{param or 'body'}: {what}", param=param or None) from None
    except Unsupported as exc:
        raise OpenAIError(400, str(exc), param=exc.param) from None
    return body


def _sampling(body: CommonFields, max_tokens: int | None, engine: Engine, prompt_len: int,
              logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:  # fmt: skip
    context = engine.resolved.context_length
    limit = max_tokens if max_tokens is not None else max(1, context - prompt_len)
    try:
        return SamplingParams(
            max_new_tokens=limit, temperature=body.temperature, top_p=body.top_p,
            stop=body.stops, seed=body.seed, ignore_eos=body.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )  # fmt: skip
    except SamplingError as exc:
        raise OpenAIError(400, str(exc), param=exc.field) from None


def prepare_completion(runtime: EngineRuntime, raw: bytes) -> Job:
    body: CompletionRequest = _validated(CompletionRequest, raw)
    engine = gen.ready(runtime)
    p = body.prompt
    if isinstance(p, str):
        texts: list[str | None] = [p]
    elif p and all(isinstance(x, str) for x in p):
        texts = list(p)  # type: ignore[arg-type]
    elif p and all(isinstance(x, int) for x in p):
        texts = [None]
        prompts = [list(p)]  # type: ignore[arg-type]
    else:
        texts = [None] * len(p)
        prompts = [list(x) for x in p]  # type: ignore[union-attr]
    if not p:
        raise OpenAIError(400, "prompt is empty; send at least one token", param="prompt")
    runtime.check_prompt_count(len(texts))
    if texts[0] is not None:
        for t in texts:
            gen.check_text(t, "prompt")  # type: ignore[arg-type]
        prompts = [engine.encode(t) for t in texts]  # type: ignore[arg-type]
    prompt_lp = body.logprobs if (body.echo and body.logprobs is not None) else None
    params = [_sampling(body, body.max_tokens, engine, len(ids), body.logprobs, prompt_lp)
              for ids in prompts]  # fmt: skip
    gen.validate(runtime, prompts, params)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Job(prompts, params, texts if body.echo else [None] * len(prompts), body.stream,
               include_usage, chat=False)  # fmt: skip


def prepare_chat(runtime: EngineRuntime, raw: bytes) -> Job:
    body: ChatCompletionRequest = _validated(ChatCompletionRequest, raw)
    engine = gen.ready(runtime)
    if engine.chat_template is None:
        raise OpenAIError(400, "this model has no chat template (tokenizer_config.json "
                          "chat_template); use /v1/completions", param="messages")  # fmt: skip
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    for m in messages:
        gen.check_text(m["content"], "messages")
    text = engine.chat_template.render(messages)
    ids = engine.encode(text)
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = [_sampling(body, body.max_completion_tokens or body.max_tokens, engine, len(ids),
                        top, None)]  # fmt: skip
    gen.validate(runtime, [ids], params)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Job([ids], params, [None], body.stream, include_usage, chat=True)


def _guarded(prepare, runtime: EngineRuntime, raw: bytes) -> Job:
    """``prepare`` with every refusal as an OpenAIError (runs in a worker thread)."""
    try:
        return prepare(runtime, raw)
    except ApiError as exc:
        raise OpenAIError(exc.status, exc.message, headers=exc.headers) from None
    except RequestError as exc:
        raise OpenAIError(400, str(exc)) from None


# ---- answers ------------------------------------------------------------------------------------
def finish_reason(out: GenerationOutput) -> str:
    reason = out.meta_info["finish_reason"] or {}
    return "length" if reason.get("type") == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def graph_report(outs: list[GenerationOutput]) -> dict:
    return {"choices": [{"prefill_batches": o.meta_info["prefill_batches"],
                         "cuda_graph": o.meta_info["cuda_graph"],
                         "decode_steps": o.meta_info["decode_steps"]} for o in outs]}  # fmt: skip


class Answers:
    """Formats one request's outputs in OpenAI's shapes."""

    def __init__(self, engine: Engine, job: Job, model: str) -> None:
        self.engine, self.job, self.model = engine, job, model
        self.created = int(time.time())

    def piece(self, token_id: int) -> str:
        """A token as text; one that is not text on its own (half a UTF-8 character, a special
        token) as ``<token N>``, so that no two alternatives share a key."""
        tok = self.engine.tokenizer
        text = tok.decode([token_id]) if tok is not None else ""
        return text if text and "\ufffd" not in text else f"<token {token_id}>"

    def completion_logprobs(self, lps: list[TokenLogprob | None], offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        at = offset
        for lp in lps:
            if lp is None:  # the first prompt token: nothing before it to score it
                continue
            tokens.append(self.piece(lp.token_id))
            token_lps.append(lp.logprob)
            tops.append({self.piece(t): v for t, v in lp.top})
            offsets.append(at)
            at += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip

    def echo_logprobs(self, i: int, out: GenerationOutput, req) -> dict:
        first = self.job.prompts[i][0]
        head = {"tokens": [self.piece(first)], "token_logprobs": [None], "top_logprobs": [None],
                "text_offset": [0]}  # fmt: skip
        rest = self.completion_logprobs(req.prompt_logprobs + req.output_logprobs,
                                        len(head["tokens"][0]))  # fmt: skip
        return {k: head[k] + rest[k] for k in head}

    def chat_logprobs(self, lps: list[TokenLogprob]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            piece = self.piece(token_id)
            return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

        content = [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]
        return {"content": content}

    def full(self, outs: list[GenerationOutput], reqs: list) -> dict:
        choices = []
        for i, (out, req) in enumerate(zip(outs, reqs, strict=True)):
            text = out.text if out.text is not None else ""
            want_lp = self.job.params[i].logprobs is not None
            if self.job.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": self.chat_logprobs(req.output_logprobs) if want_lp
                                else None, "finish_reason": finish_reason(out)})  # fmt: skip
                continue
            echo = self.job.prompt_texts[i]
            if echo is not None:
                text = echo + text
            logprobs = None
            if want_lp:
                logprobs = (self.echo_logprobs(i, out, req) if echo is not None
                            else self.completion_logprobs(req.output_logprobs, 0))  # fmt: skip
            choices.append({"index": i, "text": text, "logprobs": logprobs,
                            "finish_reason": finish_reason(out)})  # fmt: skip
        prompt_tokens = sum(len(p) for p in self.job.prompts)
        return {
            "id": ("chatcmpl-" if self.job.chat else "cmpl-") + outs[0].rid,
            "object": "chat.completion" if self.job.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompt_tokens, sum(len(o.output_ids) for o in outs)),
            "capture_service": graph_report(outs),
        }

    def chunk(self, rid: str, choice: dict) -> str:
        body = {"id": ("chatcmpl-" if self.job.chat else "cmpl-") + rid,
                "object": "chat.completion.chunk" if self.job.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}  # fmt: skip
        return f"data: {json.dumps(body)}\n\n"

    async def stream(self, runtime: EngineRuntime, handles: list[Handle], request: Request):
        first_rid = handles[0].rid
        completion = 0
        if self.job.chat:
            yield self.chunk(first_rid, {"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None})  # fmt: skip
        else:
            for i, text in enumerate(self.job.prompt_texts):
                if text is not None:  # echo: the prompt comes first
                    yield self.chunk(first_rid, {"index": i, "text": text, "logprobs": None,
                                                 "finish_reason": None})  # fmt: skip
        sent: dict[str, str] = {h.rid: "" for h in handles}
        async for i, h, kind, payload in gen.events(runtime, handles, request):
            if kind == "error":
                err = {"error": {"message": f"generation failed: {payload}", "type": "server_error",
                                 "param": None, "code": 500}}  # fmt: skip
                yield f"data: {json.dumps(err)}\n\n"
                continue
            if kind == "delta":
                delta: StreamDelta = payload  # type: ignore[assignment]
                text, reason, extra = delta.text, None, {}
            else:
                out: GenerationOutput = payload  # type: ignore[assignment]
                full = out.text or ""
                text = full[len(sent[h.rid]) :] if full.startswith(sent[h.rid]) else ""
                reason, extra = finish_reason(out), {"capture_service": graph_report([out])}
                completion += len(out.output_ids)
            sent[h.rid] += text
            if self.job.chat:
                choice = {"index": i, "delta": {"content": text} if text else {},
                          "logprobs": None, "finish_reason": reason}  # fmt: skip
            else:
                choice = {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
            yield self.chunk(h.rid, {**choice, **extra})
        if self.job.include_usage:
            body = {"id": ("chatcmpl-" if self.job.chat else "cmpl-") + first_rid,
                    "object": "chat.completion.chunk" if self.job.chat else "text_completion",
                    "created": self.created, "model": self.model, "choices": [],
                    "usage": usage(sum(len(p) for p in self.job.prompts), completion)}  # fmt: skip
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"


def add_openai_routes(app: FastAPI, runtime: EngineRuntime, served_model_name: str) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError):
        return exc.response()

    @app.get("/v1/models")
    async def models():
        card = {"id": served_model_name, "object": "model", "created": 0,
                "owned_by": "capture-service"}  # fmt: skip
        return {"object": "list", "data": [card]}

    async def run(request: Request, prepare) -> object:
        raw = await request.body()
        job: Job = await asyncio.to_thread(_guarded, prepare, runtime, raw)
        try:
            handles = gen.submit(runtime, job.prompts, job.params, stream=job.stream)
        except ApiError as exc:
            raise OpenAIError(exc.status, exc.message, headers=exc.headers) from None
        answers = Answers(runtime.ready_engine(), job, served_model_name)
        if job.stream:
            return StreamingResponse(answers.stream(runtime, handles, request),
                                     media_type="text/event-stream")  # fmt: skip
        try:
            outs = await gen.collect(runtime, handles, request)
        except ApiError as exc:
            raise OpenAIError(exc.status, exc.message, headers=exc.headers) from None
        if outs is None:
            return JSONResponse({}, status_code=499)
        reqs = [h.request for h in handles]
        return answers.full(outs, reqs)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, prepare_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, prepare_chat)
