"""The HTTP guard, a plain ASGI middleware: API key, body size and body time, before any handler.

Plain ASGI rather than Starlette's ``BaseHTTPMiddleware``, which wraps ``receive`` so that a
handler never sees the client's disconnect (an abandoned request then ran to its end) and which
leaves a keep-alive connection broken after an exception. Here:

- protected paths (and the API docs) need ``Authorization: Bearer <key>``, compared as bytes in
  constant time, so any header byte is a clean 401, never a 500;
- ``--max-body-bytes`` is enforced while the body arrives, declared (Content-Length) or not
  (chunked): 413 as soon as it is passed, without reading the rest;
- a body must arrive within ``body_timeout_s`` (a slow client, or a Content-Length larger than
  what is sent): 408, and the handler never waits longer.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from service.api.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyRejected(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def send_error(send: Send, status: int, message: str, headers: dict | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        protected: tuple[str, ...],
        max_body_bytes: int,
        body_timeout_s: float,
    ) -> None:
        self.app = app
        self.key = api_key.encode("utf-8") if api_key is not None else None
        self.protected = protected
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    def authorized(self, scope: Scope) -> bool:
        if self.key is None or not scope["path"].startswith(self.protected):
            return True
        auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        return bool(given) and hmac.compare_digest(given, self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.authorized(scope):
            return await send_error(
                send, 401, "missing or wrong API key; send 'Authorization: Bearer <key>'"
            )
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await send_error(
                send, 413, f"body of {int(length)} bytes exceeds the limit of "
                f"{self.max_body_bytes}; send a smaller body or raise --max-body-bytes",
            )  # fmt: skip
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self.limited(receive), tracked_send)
        except BodyRejected as exc:
            if not started:
                await send_error(send, exc.status, exc.message)

    def limited(self, receive: Receive) -> Receive:
        """``receive`` that counts body bytes and bounds the time the whole body may take."""
        seen = 0
        deadline = time.monotonic() + self.body_timeout_s
        body_done = False

        async def wrapped() -> Message:
            nonlocal seen, body_done
            if body_done:  # after the body only the disconnect remains: wait for it freely
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise BodyRejected(
                    408,
                    f"the request body did not arrive within {self.body_timeout_s:g} s "
                    "(a Content-Length larger than the body sent?)",
                ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyRejected(
                        413, f"body exceeds the limit of {self.max_body_bytes} bytes; send a "
                        "smaller body or raise --max-body-bytes",
                    )  # fmt: skip
                body_done = not message.get("more_body", False)
            return message

        return wrapped
