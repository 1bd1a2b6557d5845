"""The engine's loop thread and the bridge to asyncio handlers.

One thread owns the engine: it builds it (load, agree, capture: /health says 503 meanwhile),
then runs scheduler steps. Handlers never touch the scheduler; they post submissions and aborts
to an inbox and receive events on an asyncio queue per request, delivered thread-safely.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from service.api.metrics import Metrics
from service.engine import Engine, GenerationOutput
from service.errors import RankFailure
from service.sampling import SamplingParams
from service.tokenizer import IncrementalDetokenizer

log = logging.getLogger("service.runtime")

IDLE_WAIT_S = 0.05
HEALTH_CHECK_EVERY_S = 1.0


class QueueFull(RuntimeError):
    pass


class NotReady(RuntimeError):
    pass


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


def _put_all(items: list[tuple[Handle, tuple[str, object]]]) -> None:
    for h, event in items:
        h.events.put_nowait(event)


def post(items: list[tuple[Handle, tuple[str, object]]]) -> None:
    """Hand events to their handlers' loops: one thread-safe call per loop per step (each call
    wakes the loop through its self-pipe), not one per request."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for h, event in items:
        by_loop.setdefault(h.loop, []).append((h, event))
    for loop, group in by_loop.items():
        loop.call_soon_threadsafe(_put_all, group)


class EngineRuntime:
    def __init__(
        self, build: Callable[[], Engine], metrics: Metrics, max_queued_requests: int = 256
    ) -> None:
        self._build = build
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.engine: Engine | None = None
        self.state = "starting"  # starting -> ready | failed
        self.error: str | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._handles: dict[str, Handle] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)
        self._counter = 0
        self._lock = threading.Lock()
        self._last_health = 0.0

    # ---- called from handlers ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self.engine is not None:
            self.engine.shutdown()

    def health(self) -> str | None:
        if self.state == "starting":
            return "starting: loading the model and capturing prefill graphs"
        if self.state == "failed":
            return f"failed: {self.error}"
        return self.engine.failure if self.engine else "no engine"

    def ready_engine(self) -> Engine:
        if self.state != "ready" or self.engine is None:
            raise NotReady(self.health() or "not ready")
        if self.engine.failure:
            raise NotReady(f"unhealthy: {self.engine.failure}")
        return self.engine

    def submit(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        loop: asyncio.AbstractEventLoop,
        stream: bool = False,
    ) -> list[Handle]:
        """Queue the prompts of one HTTP request together, all or none.

        They enter the scheduler in one inbox item, so the loop thread never starts a prefill
        batch with only some of them (the seed's two prompts must prefill as one batch).
        """
        engine = self.ready_engine()
        for ids in prompts:
            engine.scheduler.validate(ids)  # pure read of start-up constants
        with self._lock:
            limit = engine.resolved.max_running_requests + self.max_queued_requests
            if len(self._handles) + len(prompts) > limit:
                raise QueueFull(
                    f"{len(self._handles)} requests are running or queued (limit {limit}); "
                    "retry later"
                )
            handles = []
            for ids, p in zip(prompts, params, strict=True):
                self._counter += 1
                handles.append(Handle(f"req-{self._counter}", ids, p, loop, stream=stream))
            self._handles.update((h.rid, h) for h in handles)
        self._inbox.put(("submit", handles))
        return handles

    def abort(self, rid: str, reason: str) -> None:
        self._inbox.put(("abort", (rid, reason)))

    # ---- the loop thread ---------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.engine = self._build()
            self.metrics.set_resolved(self.engine.resolved)
            self.state = "ready"
            log.info("Service ready")
        except Exception as exc:
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("Engine start-up failed")
            return
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception as exc:  # never die silently: fail loudly, keep answering
                reason = (
                    str(exc) if isinstance(exc, RankFailure) else f"{type(exc).__name__}: {exc}"
                )
                if not isinstance(exc, RankFailure):
                    log.exception("Engine loop failed")
                self.engine.fail(reason)
                self._fail_all(self.engine.failure or reason)

    def _turn(self) -> None:
        """One turn of the loop: take submissions, check health, run one step, deliver."""
        self._drain(block=not self.engine.scheduler.has_work)
        self._check_health()
        if self.engine.failure:
            self._fail_all(self.engine.failure)
            return
        if not self.engine.scheduler.has_work:
            return
        outcome = self.engine.step()
        if outcome is not None:
            self._deliver(outcome)
        self._gauges()

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                for h in payload:
                    h.request = self.engine.scheduler.add(h.prompt_ids, h.sampling, rid=h.rid)
            elif kind == "abort":
                rid, reason = payload
                h = self._handles.pop(rid, None)
                if h is not None and h.request is not None:
                    self.engine.scheduler.abort(h.request, reason)
                    log.info("Aborted %s: %s", rid, reason)
                    self.metrics.observe_finished(self.engine.output_of(h.request).meta_info, None)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                self._gauges()
                return

    def _deliver(self, outcome) -> None:
        engine = self.engine
        if outcome.result.record is not None:
            self.metrics.observe_prefill(outcome.result.record)
        if outcome.result.decode_record is not None:
            self.metrics.observe_decode(outcome.result.decode_record)
        events: list[tuple[Handle, tuple[str, object]]] = []
        for req in outcome.batch.requests:
            h = self._handles.get(req.rid)
            if h is None or not h.stream or req.finished:
                continue  # non-streaming handles wait for "done": no per-step detokenizing
            if len(req.output_ids) > h.sent:
                new = req.output_ids[h.sent :]
                h.sent = len(req.output_ids)
                if h.detok is None and engine.tokenizer is not None:
                    h.detok = IncrementalDetokenizer(engine.tokenizer.decode)
                text = h.detok.push(req.output_ids) if h.detok is not None else ""
                events.append((h, ("delta", StreamDelta(new, text))))
        for req in outcome.finished:
            h = self._handles.pop(req.rid, None)
            out: GenerationOutput = engine.output_of(req)
            ttft = (req.first_token_at - req.created_at) if req.first_token_at else None
            self.metrics.observe_finished(out.meta_info, ttft)
            if h is not None:
                events.append((h, ("done", out)))
        post(events)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for h in handles:
            h.push("error", reason)
        # new submissions are refused by ready_engine(); drop whatever raced in
        while True:
            try:
                kind, payload = self._inbox.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                return
            if kind == "submit":
                for h in payload:
                    h.push("error", reason)

    def _check_health(self) -> None:
        now = time.monotonic()
        if now - self._last_health >= HEALTH_CHECK_EVERY_S:
            self._last_health = now
            self.engine.health()

    def _gauges(self) -> None:
        s = self.engine.scheduler
        self.metrics.running.set(len(s.running))
        self.metrics.queued.set(len(s.waiting))
        self.metrics.kv_usage.set(s.kv_usage)
