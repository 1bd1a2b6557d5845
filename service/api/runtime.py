"""The engine's loop thread and its life: start-up, steps, recovery, draining, a watchdog.

One thread owns the engine: it builds it (load, agree, capture: /health says 503 meanwhile),
then runs scheduler steps. Handlers never touch the scheduler; they post submissions and aborts
to an inbox and receive events on an asyncio queue per request (service.api.handles).

- A step that raises anything fails the engine: every request gets the reason, /health turns 503,
  and the runtime rebuilds the engine (new ranks, new groups, agreement and capture again) with a
  bounded number of attempts and backoff, admitting again when ready. If that is impossible, or
  start-up itself cannot succeed, :attr:`on_fatal` asks the server to exit non-zero, so that an
  orchestrator restarts it.
- A watchdog thread notices a step that makes no progress for longer than the step timeout (a
  rank or the device hung where no deadline reaches): /health answers 503, the requests fail
  with the reason, and the server exits non-zero, since a stuck thread cannot be rebuilt.
- Draining (SIGTERM/SIGINT): new requests get 503 with Retry-After, /health says why, in-flight
  requests finish or are aborted at the drain deadline.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable

from service.api.handles import Event, Failure, Handle, StreamDelta, post
from service.api.metrics import Metrics
from service.engine import Engine, GenerationOutput
from service.errors import RankFailure, RequestError
from service.heap import freeze_start_up_heap
from service.sampling import SamplingParams
from service.tokenizer import IncrementalDetokenizer

log = logging.getLogger("service.runtime")

IDLE_WAIT_S = 0.05
HEALTH_CHECK_EVERY_S = 1.0
WATCHDOG_EVERY_S = 0.5
WATCHDOG_GRACE_S = 5.0  # beyond the step timeout, before a step counts as hung


class QueueFull(RuntimeError):
    pass


class NotReady(RuntimeError):
    pass


class EngineRuntime:
    def __init__(
        self,
        build: Callable[[], Engine],
        metrics: Metrics,
        max_queued_requests: int = 256,
        *,
        restart_attempts: int = 3,
        restart_backoff_s: float = 2.0,
        step_timeout_s: float = 30.0,
    ) -> None:
        self._build = build
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.restart_attempts = restart_attempts
        self.restart_backoff_s = restart_backoff_s
        self.hang_after_s = step_timeout_s + WATCHDOG_GRACE_S
        self.engine: Engine | None = None
        # starting -> ready <-> recovering; draining; failed (fatal)
        self.state = "starting"
        self.error: str | None = None
        self.on_fatal: Callable[[str], None] = lambda reason: None
        self._inbox: queue.Queue = queue.Queue()
        self._handles: dict[str, Handle] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="engine-loop", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._counter = 0
        self._lock = threading.Lock()
        self._last_health = 0.0
        self._step_started: float | None = None
        self._draining = False
        self._max_running = 0
        # a step's token events, handed to the handlers once the next step's device work is
        # queued: the event loop formats and writes them while the device runs, instead of
        # competing for the interpreter lock with the next step's host work
        self._undelivered: list[Event] = []

    # ---- called from handlers and the server ----------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self.engine is not None:
            self.engine.shutdown()
        gc.unfreeze()

    def health(self) -> str | None:
        if self.state == "starting":
            return "starting: loading the model and capturing prefill graphs"
        if self.state in ("failed", "recovering"):
            return f"{self.state}: {self.error}"
        if self._draining:
            return "draining: the server is shutting down"
        return self.engine.failure if self.engine else "no engine"

    def ready_engine(self) -> Engine:
        if self._draining:
            raise NotReady("the server is shutting down; retry on another replica")
        if self.state != "ready" or self.engine is None:
            raise NotReady(self.health() or "not ready")
        if self.engine.failure:
            raise NotReady(f"unhealthy: {self.engine.failure}")
        return self.engine

    @property
    def max_prompts(self) -> int:
        """The most prompts one request may hold: what can run and queue at once."""
        return self._max_running + self.max_queued_requests

    def check_prompt_count(self, n: int) -> None:
        if n > self.max_prompts:
            raise RequestError(
                f"the request holds {n} prompts; the server takes at most {self.max_prompts} at "
                f"once (max running {self._max_running} + max queued "
                f"{self.max_queued_requests}); split it into smaller requests"
            )

    def submit(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        loop: asyncio.AbstractEventLoop,
        stream: bool = False,
        probe: bool = False,
    ) -> list[Handle]:
        """Queue the prompts of one HTTP request together, all or none.

        They enter the scheduler in one inbox item, so the loop thread never starts a prefill
        batch with only some of them (the seed's two prompts must prefill as one batch).
        """
        engine = self.ready_engine()
        self.check_prompt_count(len(prompts))
        for ids in prompts:
            engine.scheduler.validate(ids)  # pure read of start-up constants
        with self._lock:
            limit = self.max_prompts
            if len(self._handles) + len(prompts) > limit:
                raise QueueFull(
                    f"{len(self._handles)} requests are running or queued (limit {limit}); "
                    "retry later"
                )
            handles = []
            for ids, p in zip(prompts, params, strict=True):
                self._counter += 1
                handles.append(
                    Handle(f"req-{self._counter}", ids, p, loop, stream=stream, probe=probe)
                )
            self._handles.update((h.rid, h) for h in handles)
        self._inbox.put(("submit", handles))
        return handles

    def abort(self, rid: str, reason: str) -> None:
        self._inbox.put(("abort", (rid, reason)))

    def begin_drain(self) -> None:
        """Stop admitting: new requests get 503, /health says the server is shutting down."""
        self._draining = True
        log.info("Draining: %d requests in flight", len(self._handles))

    def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for in-flight requests to finish, then abort the rest.
        Returns how many were aborted."""
        deadline = time.monotonic() + timeout_s
        while self._handles and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        with self._lock:
            left = list(self._handles)
        for rid in left:
            self.abort(rid, f"server shut down after its {timeout_s:g} s drain")
        wait_until = time.monotonic() + 5.0  # the aborts reach the loop thread, and answers go
        while self._handles and time.monotonic() < wait_until and self._thread.is_alive():
            time.sleep(0.05)
        if left:
            log.warning("Drain deadline: aborted %d requests", len(left))
        return len(left)

    # ---- the loop thread ---------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._set_engine(self._build())
        except Exception as exc:
            self.state, self.error = "failed", f"start-up failed: {type(exc).__name__}: {exc}"
            log.exception("Engine start-up failed")
            self.on_fatal(self.error)
            return
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception as exc:  # never die silently: fail loudly, keep answering
                self._flush()  # what earlier steps produced goes out before the failure
                reason = (
                    str(exc) if isinstance(exc, RankFailure) else f"{type(exc).__name__}: {exc}"
                )
                if not isinstance(exc, RankFailure):
                    log.exception("Engine loop failed")
                self.engine.fail(reason)
            finally:
                self._step_started = None
            if self.engine.failure and not self._stop.is_set():
                self._recover(self.engine.failure)
                if self.state == "failed":
                    return
        self._flush()

    def _set_engine(self, engine: Engine) -> None:
        self.engine = engine
        self._max_running = engine.resolved.max_running_requests
        self.metrics.set_resolved(engine.resolved)
        self.metrics.engine_healthy.set(1)
        freeze_start_up_heap("server")
        self.state, self.error = "ready", None
        log.info("Service ready")

    def _recover(self, reason: str) -> None:
        """Fail every request with ``reason``, then rebuild the engine, with backoff."""
        self.metrics.engine_healthy.set(0)
        self.state, self.error = "recovering", f"engine failed ({reason}); rebuilding it"
        self._fail_all(reason)
        try:
            self.engine.shutdown()  # the failed engine stays for health() until replaced
        except Exception:
            log.exception("Shutting down the failed engine")
        gc.unfreeze()  # the failed engine's objects are garbage now; the next build refreezes
        for attempt in range(1, self.restart_attempts + 1):
            if self._stop.wait(self.restart_backoff_s * 2 ** (attempt - 1)):
                return
            self.error = f"rebuilding the engine (attempt {attempt}/{self.restart_attempts}) " \
                         f"after: {reason}"  # fmt: skip
            log.warning("Engine restart %d/%d after: %s", attempt, self.restart_attempts, reason)
            try:
                engine = self._build()
            except Exception as exc:
                log.error("Engine restart %d failed: %s: %s", attempt, type(exc).__name__, exc)
                continue
            self.metrics.engine_restarts.inc()
            self._set_engine(engine)
            return
        self.state = "failed"
        self.error = f"the engine could not be rebuilt in {self.restart_attempts} attempts " \
                     f"after: {reason}"  # fmt: skip
        log.error("%s", self.error)
        self.on_fatal(self.error)

    def _turn(self) -> None:
        """One turn of the loop: take submissions, check health, run one step, deliver."""
        self._take(block=not self.engine.scheduler.has_work)
        self._check_health()
        if self.engine.failure or not self.engine.scheduler.has_work:
            self._flush()
            return
        self._step_started = time.monotonic()
        outcome = self.engine.step(on_launched=self._flush)
        self._step_started = None
        self._flush()  # a step that ran no batch never called the hook: deliver here
        if outcome is not None:
            self._deliver(outcome)
        if not self.engine.scheduler.has_work:
            self._flush()  # no next step to wait for
        self._gauges()

    def _flush(self) -> None:
        if self._undelivered:
            events, self._undelivered = self._undelivered, []
            post(events)

    def _take(self, block: bool) -> None:
        """Submissions and aborts from the handlers, into the scheduler."""
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
                    if not h.probe:
                        meta = self.engine.output_of(h.request).meta_info
                        self.metrics.observe_finished(meta, None)
                    h.push("error", Failure(reason, retryable=self._draining))
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
        events: list[Event] = []
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
            if h is None or not h.probe:
                ttft = (req.first_token_at - req.created_at) if req.first_token_at else None
                self.metrics.observe_finished(out.meta_info, ttft)
            if h is not None:
                events.append((h, ("done", out)))
        self._undelivered += events  # posted by _flush

    def _fail_all(self, reason: str) -> None:
        """Every request in flight, and whatever raced into the inbox, gets the error."""
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                handles += payload
        post([(h, ("error", Failure(reason, retryable=False))) for h in handles])
        failed = sum(1 for h in handles if not h.probe)
        if failed:
            self.metrics.failed_requests.inc(failed)

    def _check_health(self) -> None:
        now = time.monotonic()
        if now - self._last_health >= HEALTH_CHECK_EVERY_S:
            self._last_health = now
            self._flush()  # a rank ping can take a while: deliver first
            self.engine.health()

    def _gauges(self) -> None:
        s = self.engine.scheduler
        self.metrics.running.set(len(s.running))
        self.metrics.queued.set(len(s.waiting))
        self.metrics.kv_usage.set(s.kv_usage)

    # ---- the watchdog thread -----------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(WATCHDOG_EVERY_S):
            started = self._step_started
            if started is None or self.state != "ready":
                continue
            stuck = time.monotonic() - started
            if stuck > self.hang_after_s:
                reason = (
                    f"a step made no progress for {stuck:.0f} s (step timeout "
                    f"{self.hang_after_s - WATCHDOG_GRACE_S:g} s); the engine is hung"
                )
                log.error("Watchdog: %s", reason)
                self.metrics.engine_healthy.set(0)
                self.state, self.error = "failed", reason
                self._fail_all(reason)
                self.on_fatal(reason)
                return
