"""The engine loop never dies silently: a step that raises anything fails the engine loudly."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from service.api.app import ApiSettings, create_app
from service.api.metrics import Metrics
from service.api.runtime import EngineRuntime
from service.config import EngineConfig, GraphConfig
from service.engine import Engine
from tests.faults import FaultyLocalExecutor


def test_an_exception_in_a_step_fails_requests_and_health():
    cfg = EngineConfig(device="cpu", context_length=128, kv_cache_memory_bytes=16 << 20,
                       graph=GraphConfig(backend="breakable", buckets=(64,)))  # fmt: skip
    # forward 1 is the prefill; forward 2, the first decode step, raises a plain ValueError
    runtime = EngineRuntime(
        lambda: Engine(cfg, executor=FaultyLocalExecutor(cfg, raise_on_forward=2)), Metrics()
    )
    client = TestClient(create_app(runtime, ApiSettings()))
    runtime.start()
    try:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, client.get("/health").text
            time.sleep(0.1)
        answers: list = []
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5}}
        post = threading.Thread(target=lambda: answers.append(client.post("/generate", json=body)))
        post.start()
        post.join(timeout=60)
        assert answers, "the request hung: the engine loop died without failing it"
        (r,) = answers
        assert r.status_code == 500
        assert "ValueError: injected forward failure" in r.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503
        assert "ValueError: injected forward failure" in health.json()["error"]["message"]
        again = client.post("/generate", json={"input_ids": [1]})
        assert again.status_code == 503 and "injected" in again.json()["error"]["message"]
        assert runtime._thread.is_alive()  # the loop thread lives on to answer and refuse
    finally:
        runtime.stop()
