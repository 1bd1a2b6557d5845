"""The engine loop never dies silently: a failed step fails its requests loudly, the engine is
rebuilt, and a hung step (where no deadline reaches) is caught by the watchdog."""

from __future__ import annotations

import gc
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi.testclient import TestClient

from service.api import runtime as runtime_module
from service.api.app import ApiSettings, create_app
from service.api.metrics import Metrics
from service.api.runtime import EngineRuntime
from service.config import EngineConfig, GraphConfig
from service.engine import Engine
from tests.faults import FaultyLocalExecutor

CFG = EngineConfig(device="cpu", context_length=128, kv_cache_memory_bytes=16 << 20,
                   graph=GraphConfig(backend="breakable", buckets=(64,)))  # fmt: skip
BODY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5}}


def post(client: TestClient, body: dict, timeout: float = 60) -> object:
    """A POST that cannot hang the test: a dead engine loop would never answer."""
    answers: list = []
    t = threading.Thread(target=lambda: answers.append(client.post("/generate", json=body)))
    t.start()
    t.join(timeout)
    assert answers, "the request hung: the engine loop died without failing it"
    return answers[0]


def wait_health(client: TestClient, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while client.get("/health").status_code != status:
        assert time.monotonic() < deadline, client.get("/health").text
        time.sleep(0.05)


@contextmanager
def serving(runtime: EngineRuntime, join: bool = True) -> Iterator[tuple[TestClient, list[str]]]:
    """The runtime started behind a test client, healthy; yields the client and the reasons
    passed to ``on_fatal``. ``join=False`` leaves a hung loop thread (a daemon) unjoined."""
    fatal: list[str] = []
    runtime.on_fatal = fatal.append
    client = TestClient(create_app(runtime, ApiSettings()))
    runtime.start()
    try:
        wait_health(client, 200, 120)
        yield client, fatal
    finally:
        if join:
            runtime.stop()
        else:
            runtime._stop.set()


def test_an_exception_in_a_step_fails_requests_then_the_engine_is_rebuilt():
    builds = itertools.count()

    def build() -> Engine:
        # the first engine's first decode step (forward 2) raises a plain ValueError
        n = next(builds)
        return Engine(
            CFG, executor=FaultyLocalExecutor(CFG, raise_on_forward=2 if n == 0 else None)
        )

    metrics = Metrics()
    runtime = EngineRuntime(build, metrics, restart_backoff_s=0.5)
    with serving(runtime) as (client, fatal):
        r = post(client, BODY)
        assert r.status_code == 500
        assert "ValueError: injected forward failure" in r.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503 and "ValueError" in health.json()["error"]["message"]
        assert post(client, {"input_ids": [1]}).status_code == 503
        wait_health(client, 200, 60)  # rebuilt
        assert gc.get_freeze_count() > 0  # the new engine's start-up heap is frozen again
        assert post(client, BODY).status_code == 200
        text = metrics.render().decode()
        assert "capture_service_engine_restarts_total 1.0" in text
        assert "capture_service_failed_requests_total 1.0" in text
        assert "capture_service_engine_healthy 1.0" in text
        assert not fatal


def test_an_engine_that_cannot_be_rebuilt_exits_non_zero():
    builds = itertools.count()

    def build() -> Engine:
        if next(builds) > 0:
            raise RuntimeError("the device is gone")
        return Engine(CFG, executor=FaultyLocalExecutor(CFG, raise_on_forward=1))

    runtime = EngineRuntime(build, Metrics(), restart_attempts=2, restart_backoff_s=0.1)
    with serving(runtime) as (client, fatal):
        assert post(client, BODY).status_code == 500
        deadline = time.monotonic() + 30
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fatal and "could not be rebuilt in 2 attempts" in fatal[0]
        assert "failed" in client.get("/health").json()["error"]["message"]


def test_the_watchdog_catches_a_step_that_never_returns(monkeypatch):
    monkeypatch.setattr(runtime_module, "WATCHDOG_GRACE_S", 0.5)
    runtime = EngineRuntime(
        lambda: Engine(CFG, executor=FaultyLocalExecutor(CFG, hang_on_forward=2)),
        Metrics(),
        step_timeout_s=1.0,
    )
    with serving(runtime, join=False) as (client, fatal):  # the hung loop cannot be joined
        t0 = time.monotonic()
        r = post(client, BODY, timeout=20)
        assert r.status_code == 500 and "no progress" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 5  # within the step timeout and the grace
        assert client.get("/health").status_code == 503
        assert fatal and "the engine is hung" in fatal[0]  # a stuck thread: exit, be restarted


def test_the_start_up_heap_leaves_the_garbage_collector_until_stop():
    """A full collection over start-up's objects (~300k, ~200 ms here) must not land on the
    first request: the runtime collects and freezes them before it reports ready, and unfreezes
    when it stops (a rebuilt engine refreezes: the rebuild test)."""
    gc.unfreeze()
    runtime = EngineRuntime(lambda: Engine(CFG), Metrics())
    with serving(runtime) as (client, fatal):
        frozen = gc.get_freeze_count()
        assert frozen > 10_000, frozen  # the model's modules, the captured graphs, imports
        assert post(client, BODY).status_code == 200 and not fatal
    assert gc.get_freeze_count() == 0
