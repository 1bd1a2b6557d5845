"""A step's tokens reach the HTTP handlers while the next step's device work runs, never later
than the moment the engine goes idle, and never twice.

The engine loop hands a step's token events to the event loop from the next step's
``on_launched`` hook: after a decode graph's replay and sampling are queued (the event loop then
formats and writes the tokens while the device works, instead of competing for the interpreter
lock with the next step's host work), at once for host-bound steps (prefill, eager decode).
A fake that delivered at the end of every step, or that held events back when no step follows,
fails these tests; so does a hook called after the step's wait for its tokens.
"""

from __future__ import annotations

import itertools
import json

import pytest
from fastapi.testclient import TestClient

from service.api import runtime as runtime_module
from service.api.metrics import Metrics
from service.api.runtime import EngineRuntime
from service.config import DecodeGraphConfig, EngineConfig, GraphConfig
from service.engine import Engine
from service.executors.local import LocalExecutor
from service.ranks import worker as worker_module
from service.sampling import SamplingParams
from tests.test_runtime_failures import serving

CFG = EngineConfig(
    device="cpu", dtype="float32", context_length=96, max_running_requests=4,
    chunked_prefill_size=128, kv_cache_memory_bytes=16 << 20,
    graph=GraphConfig(backend="breakable", buckets=(64, 128)),
    decode=DecodeGraphConfig(enabled=True, sizes=(1, 2, 4)),
)  # fmt: skip


class RecordingExecutor(LocalExecutor):
    """The in-process executor; logs each forward's phases: the prefill or decode-graph forward,
    the launch hook, the wait for the sampled ids, the return."""

    def __init__(self, cfg: EngineConfig, log: list[tuple]) -> None:
        super().__init__(cfg)
        self.log = log
        self.steps = 0
        w = self.worker

        def wrap(obj, name: str, tag: str) -> None:
            inner = getattr(obj, name)

            def spy(*args, **kwargs):
                self.log.append((tag, self.steps))
                return inner(*args, **kwargs)

            setattr(obj, name, spy)

        wrap(w.eager_runner, "run", "forward")

        original_build = w.build_runners

        def build_runners(prefill, decode) -> None:
            original_build(prefill, decode)
            wrap(w.runner, "run", "forward")
            if w.decode_runner is not None:
                wrap(w.decode_runner, "run", "replay")

        w.build_runners = build_runners

    def execute(self, cmd, on_launched=None):
        self.steps += 1
        n = self.steps

        def launched() -> None:
            self.log.append(("launched", n))
            if on_launched is not None:
                on_launched()

        result = super().execute(cmd, launched)
        self.log.append(("returned", n))
        return result


class WaitSpy:
    """The sampled ids; logs when the worker waits for them (their copy to the host)."""

    def __init__(self, ids, log: list[tuple], step: int) -> None:
        self.ids, self.log, self.step = ids, log, step

    def tolist(self) -> list[int]:
        self.log.append(("wait", self.step))
        return self.ids.tolist()


def test_the_hook_runs_after_a_decode_replay_is_queued_and_before_a_prefill(monkeypatch):
    log: list[tuple] = []
    executor = RecordingExecutor(CFG, log)
    real_sample = worker_module.sample_ids
    monkeypatch.setattr(
        worker_module,
        "sample_ids",
        lambda *a: WaitSpy(real_sample(*a), log, executor.steps),
    )
    engine = Engine(CFG, executor=executor)
    req = engine.add([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    hooks = 0

    def hook() -> None:
        nonlocal hooks
        hooks += 1

    while not req.finished:
        engine.step(on_launched=hook)
    assert len(req.output_ids) == 4 and hooks == 4  # once per step
    steps = [[tag for tag, n in log if n == k] for k in range(1, 5)]
    # prefill: host-bound, the hook first
    assert steps[0] == ["launched", "forward", "wait", "returned"]
    for s in steps[1:]:  # decode graph replays: the hook after the replay is queued, before the
        assert s == ["replay", "launched", "wait", "returned"]  # wait for the sampled ids
    assert req.decode_graph_steps == 3


def test_a_steps_tokens_are_posted_once_the_next_step_launched(monkeypatch):
    """Through the runtime: each streamed token's event goes out from the next step's hook, the
    last ones when the engine goes idle; the stream holds every token once, in order."""
    log: list[tuple] = []
    posts: list[list[str]] = []
    real_post = runtime_module.post

    def recording_post(items) -> None:
        kinds = [event[0] for _, event in items]
        log.append(("post", tuple(kinds)))
        posts.append(kinds)
        real_post(items)

    monkeypatch.setattr(runtime_module, "post", recording_post)
    monkeypatch.setattr(runtime_module, "HEALTH_CHECK_EVERY_S", 3600.0)  # no flush on a ping
    runtime = EngineRuntime(lambda: Engine(CFG, executor=RecordingExecutor(CFG, log)), Metrics())
    with serving(runtime) as (client, fatal):
        assert isinstance(client, TestClient)
        log.clear()
        params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": [3, 1, 4, 1, 5], "stream": True, "sampling_params": params}
        r = client.post("/generate", json=body)
        assert r.status_code == 200
        chunks = [
            json.loads(line[len("data: ") :])
            for line in r.text.splitlines()
            if line.startswith("data: {")
        ]
        assert not fatal
    ids = chunks[-1]["output_ids"]
    assert len(ids) == 5 and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(chunks) == 5  # four deltas and the final answer
    for a, b in itertools.pairwise(chunks):  # cumulative, in order, nothing twice
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    deltas = [k for k in posts if "delta" in k]
    assert len(deltas) == 4  # tokens 1-4 stream as deltas; the 5th comes with "done"
    # every delta post sits between the launch of a later step and that step's return
    for i, entry in enumerate(log):
        if entry[0] == "post" and "delta" in entry[1]:
            launched = [e for e in log[:i] if e[0] == "launched"]
            returned = [e for e in log[:i] if e[0] == "returned"]
            assert launched and launched[-1][1] == len(returned) + 1, log
    # "done" goes out when no step follows: after the last return, not held back
    assert log[-1] == ("post", ("done",)) and log[-2][0] == "returned", log


@pytest.mark.parametrize("decode_graphs", [True, False])
def test_eager_and_graph_steps_call_the_hook_exactly_once(decode_graphs):
    cfg = EngineConfig(**{**CFG.__dict__, "decode": DecodeGraphConfig(enabled=decode_graphs)})
    log: list[tuple] = []
    engine = Engine(cfg, executor=RecordingExecutor(cfg, log))
    reqs = [
        engine.add(list(range(1, 2 + i)), SamplingParams(max_new_tokens=3 + i, ignore_eos=True))
        for i in range(3)
    ]
    calls = 0

    def hook() -> None:
        nonlocal calls
        calls += 1

    steps = 0
    while any(not r.finished for r in reqs):
        engine.step(on_launched=hook)
        steps += 1
    assert calls == steps
    assert [len(r.output_ids) for r in reqs] == [3, 4, 5]
    for k in range(2, steps + 1):  # decode steps: eager ones are host-bound, hook first
        phases = [tag for tag, n in log if n == k]
        want = ["replay", "launched"] if decode_graphs else ["launched", "forward"]
        assert phases == [*want, "returned"], (k, phases)
