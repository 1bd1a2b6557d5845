"""The bridge from the engine thread to the asyncio handlers: one handle per prompt.

The engine thread never touches the event loop's objects directly: it posts events with
``loop.call_soon_threadsafe``, batched per step (:func:`post`), and each handler reads its
handle's queue.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from service.sampling import SamplingParams
from service.tokenizer import IncrementalDetokenizer


@dataclass
class Handle:
    """One request's channel back to its HTTP handler."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: object | None = None  # the scheduler's Request, set by the loop thread
    stream: bool = False  # only streaming handles are sent partial outputs
    probe: bool = False  # a /health_generate probe: kept out of the request metrics
    sent: int = 0  # output tokens already streamed
    submitted_at: float = field(default_factory=time.perf_counter)
    detok: IncrementalDetokenizer | None = None  # streaming text, a bounded window per step

    def push(self, kind: str, payload: object) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


@dataclass(frozen=True)
class StreamDelta:
    """What one step added to a streaming request: its new token ids and text."""

    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class Failure:
    """Why a request ended without an answer; ``retryable``: another try may succeed (the
    server was shutting down), so the API answers 503 rather than 500."""

    message: str
    retryable: bool = False

    def __str__(self) -> str:
        return self.message


Event = tuple[Handle, tuple[str, object]]


def _put_all(items: list[Event]) -> None:
    for h, event in items:
        h.events.put_nowait(event)


def post(items: list[Event]) -> None:
    """Hand events to their handlers' loops: one thread-safe call per loop per step (each call
    wakes the loop through its self-pipe), not one per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Event]] = {}
    for h, event in items:
        by_loop.setdefault(h.loop, []).append((h, event))
    for loop, group in by_loop.items():
        if not loop.is_closed():
            loop.call_soon_threadsafe(_put_all, group)
