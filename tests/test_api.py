"""The HTTP service end to end: a real server process and a real HTTP client."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server_proc import ServerProcess

SEED_ARGS = (
    "--context-length", "2048", "--max-running-requests", "8", "--chunked-prefill-size", "4096",
    "--prefill-buckets", "4096",
)  # fmt: skip
GREEDY4 = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("backend", ["breakable", "tc_piecewise", "full"])
def test_seed_scenario_end_to_end(backend, tmp_path):
    run_seed_scenario(backend, "cpu", tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["breakable", "tc_piecewise", "full"])
def test_seed_scenario_on_cuda(backend, tmp_path):
    run_seed_scenario(backend, "cuda", tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["breakable", "tc_piecewise", "full"])
def test_seed_scenario_on_cuda_with_flashinfer(backend, tmp_path):
    """A bf16 model of head dim 128: serve picks FlashInfer by itself (`full` in its CUDA-graph
    mode); in-process, since the Ray and FlashInfer wheels do not travel to the GPU together."""
    pytest.importorskip("flashinfer", reason="needs FlashInfer (the gpu extra)")
    from tests.fi_model import write_fi_model

    model = write_fi_model(tmp_path / "model")
    extra = ("--model", str(model), "--load-format", "random", "--dtype", "bfloat16")
    info = run_seed_scenario(backend, "cuda", tmp_path, extra=extra, executor="local")
    assert info["attention_backend"]["name"] == "flashinfer"


def run_seed_scenario(
    backend: str, device: str, tmp_path, extra: tuple[str, ...] = (), executor: str | None = ""
) -> dict:
    kind = "cuda" if device == "cuda" else "cpu"
    if executor == "":  # breakable runs serve's default, the rank in a Ray actor; others local
        executor = None if backend == "breakable" else "local"
    server = ServerProcess(*SEED_ARGS, "--prefill-backend", backend, "--device", device, *extra,
                           log_path=tmp_path / "log", executor=executor)  # fmt: skip
    try:
        hits_before = server.metric("capture_service_prefill_batches_total", result="hit",
                                    reason="none")  # fmt: skip
        prompts = ["ab" * 650 + "c", "xy" * 650 + "z"]  # 1,301 byte tokens each
        r = httpx.post(server.url + "/generate",
                       json={"text": prompts, "sampling_params": GREEDY4}, timeout=300)  # fmt: skip
        assert r.status_code == 200, r.text
        answers = r.json()
        assert len(answers) == 2
        for a in answers:
            m = a["meta_info"]
            assert m["prompt_tokens"] == 1301 and m["completion_tokens"] == 4
            assert len(a["output_ids"]) == 4 and isinstance(a["text"], str)
            (batch,) = m["prefill_batches"]
            assert batch["num_tokens"] == 2602 and batch["num_requests"] == 2
            assert batch["graph_hit"] is True and batch["bucket"] == 4096
            assert batch["graph_kind"] == kind and m["cuda_graph"] is (kind == "cuda")
        assert "#new-seq: 2, #new-token: 2602" in server.log()
        assert f"graph: hit (bucket 4096, {kind})" in server.log()
        hits = server.metric("capture_service_prefill_batches_total", result="hit", reason="none")
        assert hits == hits_before + 1
        info = httpx.get(server.url + "/server_info", timeout=10).json()
        assert info["prefill_backend"] == backend
        assert info["executor"] == ("ray" if executor is None else "local")
        assert info["buckets"][0]["num_tokens"] == 4096
        lens = [n for n in info["buckets"][0]["capture_seq_lens"] if n]
        assert lens == [2048, 2048]
        assert info["capture"][0]["buckets"][0]["num_tokens"] == 4096
        return info
    finally:
        server.stop()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A small server with an API key, a small body limit and a queue of one."""
    server = ServerProcess(
        "--context-length", "1024", "--max-running-requests", "1", "--max-queued-requests", "1",
        "--chunked-prefill-size", "256", "--prefill-buckets", "64,256", "--api-key", "sekret",
        "--max-body-bytes", "20000",
        log_path=tmp_path_factory.mktemp("guarded") / "log",
    )  # fmt: skip
    yield server
    server.stop()


AUTH = {"Authorization": "Bearer sekret"}
GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def ok_after(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/generate", json=GOOD, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) <= 2


@pytest.mark.parametrize(
    ("body", "status", "needles"),
    [
        ({"input_ids": [1] * 1025}, 400, ["1025 tokens", "context length 1024"]),
        ({"input_ids": []}, 400, ["empty"]),
        ({"text": ""}, 400, ["empty"]),
        ({"text": "a", "input_ids": [1]}, 400, ["exactly one of 'text' or 'input_ids'"]),
        ({}, 400, ["exactly one of 'text' or 'input_ids'"]),
        ({"input_ids": [1, 5000]}, 400, ["outside the vocabulary"]),
        ({"text": "a", "sampling_params": {"temperature": -1}}, 400, ["temperature"]),
        ({"text": "a", "sampling_params": {"top_p": 2}}, 400, ["top_p"]),
        ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, 400, ["max_new_tokens"]),
        ({"text": "a", "sampling_params": {"max_new_tokens": "x"}}, 400, ["max_new_tokens"]),
        ({"text": "a", "sampling_params": {"topk": 3}}, 400, ["topk"]),
    ],
)
def test_bad_input_gets_a_clear_400_and_the_server_keeps_serving(guarded, body, status, needles):
    r = httpx.post(guarded.url + "/generate", json=body, headers=AUTH, timeout=30)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    for n in needles:
        assert n in message
    assert "Traceback" not in r.text
    ok_after(guarded)


def test_not_json_too_big_and_auth(guarded):
    r = httpx.post(guarded.url + "/generate", content=b"{not json", headers=AUTH, timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    ok_after(guarded)
    big = json.dumps({"input_ids": [1] * 10_000})
    r = httpx.post(guarded.url + "/generate", content=big, headers=AUTH, timeout=30)
    assert r.status_code == 413 and "exceeds the limit of 20000" in r.json()["error"]["message"]
    ok_after(guarded)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(guarded.url + "/generate", json=GOOD, headers=headers, timeout=30)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(guarded.url + "/health", timeout=10).status_code == 200  # probes stay open
    assert httpx.get(guarded.url + "/server_info", timeout=10).status_code == 401
    ok_after(guarded)


def _long_stream(server: ServerProcess, stop: threading.Event, started: threading.Event):
    body = {
        "input_ids": [7] * 10,
        "stream": True,
        "sampling_params": {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True},
    }
    with httpx.stream("POST", server.url + "/generate", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                return  # leaving the context manager closes the connection mid-stream


def test_full_queue_503_and_disconnect_frees_kv(guarded):
    aborted_before = guarded.metric("capture_service_requests_total", finish_reason="abort")
    stop = threading.Event()
    started = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_long_stream, args=(guarded, stop, s)) for s in started]
    threads[0].start()
    assert started[0].wait(60)  # the one running request
    threads[1].start()  # the one queued request (it starts streaming only when the first ends)
    time.sleep(0.5)
    r = httpx.post(guarded.url + "/generate", json=GOOD, headers=AUTH, timeout=30)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert "retry later" in r.json()["error"]["message"]
    stop.set()
    for t in threads:
        t.join(60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if guarded.metric("capture_service_kv_usage_ratio") == 0.0:
            break
        time.sleep(0.2)
    assert guarded.metric("capture_service_kv_usage_ratio") == 0.0
    aborted = guarded.metric("capture_service_requests_total", finish_reason="abort")
    assert aborted >= aborted_before + 2
    assert "client disconnected" in guarded.log()
    ok_after(guarded)


def test_streaming_sse(guarded):
    body = {**GOOD, "stream": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                        "ignore_eos": True}}  # fmt: skip
    with httpx.stream("POST", guarded.url + "/generate", json=body, headers=AUTH, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    r = httpx.get(guarded.url + "/health_generate", headers=AUTH, timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 1


def test_tp2_serving_matches_tp1(ray_local, tmp_path):
    from service.config import EngineConfig, GraphConfig
    from service.engine import Engine
    from service.sampling import SamplingParams

    args = ("--context-length", "128", "--max-running-requests", "4",
            "--chunked-prefill-size", "256", "--prefill-buckets", "64,256",
            "--kv-cache-memory-bytes", "16777216")  # fmt: skip
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 5, [2, 7, 1, 8] * 3]
    ref = Engine(EngineConfig(context_length=128, max_running_requests=4, chunked_prefill_size=256,
                              kv_cache_memory_bytes=16 << 20,
                              graph=GraphConfig(buckets=(64, 256)))).generate(
        prompts, SamplingParams(max_new_tokens=5, ignore_eos=True))  # fmt: skip
    server = ServerProcess(*args, "--tp", "2", log_path=tmp_path / "log", executor="ray")
    try:
        info = httpx.get(server.url + "/server_info", timeout=10).json()
        assert info["tp"] == 2 and len(info["capture"]) == 2
        body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                          "ignore_eos": True}}  # fmt: skip
        r = httpx.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert [a["output_ids"] for a in r.json()] == [o.output_ids for o in ref]
    finally:
        server.stop()
