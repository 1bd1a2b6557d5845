"""Reliability under hostile clients and faults: real server processes, real sockets, loopback.

Each test names the defect it guards against (issue: reliability under faults and hostile
clients); every loop here is bounded in time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server_proc import ServerProcess

pytestmark = pytest.mark.slow


def wait_for(predicate, timeout: float, every: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def raw_post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None,
             chunked: bool = False) -> socket.socket:  # fmt: skip
    """An HTTP/1.1 POST written by hand on a raw socket (left open for the caller)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if chunked:
        head.append("Transfer-Encoding: chunked")
    elif "Content-Length" not in (headers or {}):
        head.append(f"Content-Length: {len(body)}")
    s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    if body and not chunked:
        s.sendall(body)
    return s


def response_status(s: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]) if data else 0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A small server: context 4096, a pool of 8, a body limit of 1 MB read within 2 s."""
    s = ServerProcess(
        "--context-length", "4096", "--max-running-requests", "8", "--max-queued-requests", "4",
        "--prefill-buckets", "64,256", "--max-body-bytes", str(1 << 20), "--body-timeout", "2",
        log_path=tmp_path_factory.mktemp("reliability") / "log",
    )  # fmt: skip
    yield s
    s.stop()


def long_body(n: int = 3000) -> bytes:
    return json.dumps({"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}}).encode()  # fmt: skip


def test_abandoned_non_streaming_requests_are_aborted_within_a_second(server):
    """Item 1: a client that closes its socket stops its (non-streaming) request at once."""
    aborted = server.metric("capture_service_requests_total", finish_reason="abort")
    socks = [raw_post(server.port, "/generate", long_body()) for _ in range(4)]
    assert wait_for(lambda: server.metric("capture_service_running_requests") == 4, 30)
    for s in socks:
        s.close()
    t0 = time.monotonic()
    assert wait_for(lambda: server.metric("capture_service_running_requests") == 0, 5)
    assert time.monotonic() - t0 < 2.0
    assert server.metric("capture_service_kv_usage_ratio") == 0.0
    assert server.metric("capture_service_requests_total", finish_reason="abort") == aborted + 4
    t0 = time.monotonic()
    r = httpx.post(server.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2}}, timeout=30)  # fmt: skip
    assert r.status_code == 200 and time.monotonic() - t0 < 5


def test_a_body_over_the_limit_is_refused_while_it_arrives(server):
    """Item 5: a chunked upload (no Content-Length) past --max-body-bytes is a 413 as soon as
    the limit is passed, and /health stays quick meanwhile."""
    s = raw_post(server.port, "/generate", b"", chunked=True)
    chunk = b"x" * 65536
    sent = 0
    status = 0
    t0 = time.monotonic()
    try:
        while sent < 8 << 20:
            s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            sent += len(chunk)
            if sent > (1 << 20) + len(chunk):
                s.settimeout(5)
                status = response_status(s)
                break
    except OSError:  # the server may close the connection before we stop sending
        status = response_status(s)
    finally:
        s.close()
    assert status == 413
    assert sent < 2 << 20 and time.monotonic() - t0 < 5
    t0 = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert time.monotonic() - t0 < 1.0


def test_a_body_that_never_arrives_times_out(server):
    """Item 5: a Content-Length larger than what is sent ends in 408 after --body-timeout."""
    s = raw_post(server.port, "/generate", b'{"input_ids": [1', {"Content-Length": "1000"})
    s.settimeout(10)
    t0 = time.monotonic()
    status = response_status(s)
    s.close()
    assert status == 408 and 1.5 < time.monotonic() - t0 < 6


def test_a_huge_prompt_never_stalls_health(server):
    """Item 5: tokenizing and validating run off the event loop; /health answers meanwhile."""
    text = "a" * 900_000  # under the 1 MB body limit, far over the context
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            httpx.get(server.url + "/health", timeout=10)
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)

    t = threading.Thread(target=probe)
    t.start()
    try:
        r = httpx.post(server.url + "/generate", json={"text": text}, timeout=60)
    finally:
        done.set()
        t.join(10)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    assert latencies and max(latencies) < 0.5


@pytest.mark.parametrize(
    ("raw", "headers", "status", "needle"),
    [
        (b'{"text": "\\ud800"}', {}, 400, "lone surrogate"),
        (b"[" * 100_000 + b"]" * 100_000, {}, 400, "nested too deeply"),
        (b'{"input_ids": [1], "sampling_param": {"max_new_tokens": 2}}', {}, 400,
         "sampling_param"),
        (b'{"input_ids": ["1"]}', {}, 400, "input_ids"),
        (b'{"input_ids": [true]}', {}, 400, "input_ids"),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": "4"}}', {}, 400,
         "max_new_tokens"),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1000000000}}', {}, 400,
         "exceeds the context length 4096"),
        (json.dumps({"input_ids": [[1]] * 1000}).encode(), {}, 400, "at most 12"),
    ],
)  # fmt: skip
def test_hostile_inputs_get_a_4xx_and_the_connection_stays_usable(server, raw, headers, status,
                                                                  needle):  # fmt: skip
    """Items 6 and 7: each case is a 4xx that names the problem, never a 500; the same
    keep-alive connection then serves a good request."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/generate", content=raw, headers={"Content-Type": "application/json",
                                                           **headers})  # fmt: skip
        assert r.status_code == status, r.text
        assert needle in r.json()["error"]["message"]
        for _ in range(3):
            ok = client.post("/generate", json={"input_ids": [1], "sampling_params": {
                "max_new_tokens": 1}})  # fmt: skip
            assert ok.status_code == 200


def test_head_health_and_a_non_ascii_authorization_header(server):
    assert httpx.head(server.url + "/health", timeout=10).status_code == 200
    s = raw_post(
        server.port,
        "/generate",
        b'{"input_ids": [1]}',
        {"Authorization": "Bearer \xe9t\xe9".encode("latin-1").decode("latin-1")},
    )
    s.settimeout(10)
    assert response_status(s) == 200  # no key configured: the header is ignored, not a 500
    s.close()


def test_an_api_key_guards_the_docs_and_survives_non_ascii(tmp_path):
    """Items 6 and 7: a non-ASCII key works; a non-ASCII header is a 401; docs need the key."""
    key = "clé-secrète"
    s = ServerProcess("--context-length", "256", "--prefill-buckets", "64", "--api-key", key,
                      log_path=tmp_path / "log")  # fmt: skip
    try:
        raw_key = ("Bearer " + key).encode()
        r = httpx.post(s.url + "/generate", json={"input_ids": [1]},
                       headers=[(b"Authorization", raw_key)], timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        for path in ("/docs", "/redoc", "/openapi.json", "/server_info"):
            assert httpx.get(s.url + path, timeout=10).status_code == 401
        assert httpx.get(s.url + "/openapi.json", headers=[(b"Authorization", raw_key)],
                         timeout=10).status_code == 200  # fmt: skip
        sock = raw_post(
            s.port, "/generate", b'{"input_ids": [1]}', {"Authorization": "Bearer \xff"}
        )
        sock.settimeout(10)
        assert response_status(sock) == 401
        sock.close()
    finally:
        s.stop()


def _inflight(url: str, n: int, results: list, max_new_tokens: int) -> list[threading.Thread]:
    def one() -> None:
        try:
            r = httpx.post(url + "/generate", json={"input_ids": [3, 4], "sampling_params": {
                "max_new_tokens": max_new_tokens, "ignore_eos": True}}, timeout=120)  # fmt: skip
            results.append(r.status_code)
        except httpx.HTTPError as exc:
            results.append(type(exc).__name__)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("executor", ["local", "ray"])
def test_sigterm_drains_finishes_in_flight_work_and_exits_zero(tmp_path, executor):
    """Item 2: SIGTERM stops admitting (503 + Retry-After, /health 503), lets in-flight requests
    finish, stops the ranks and Ray, exits 0; the same with SIGINT."""
    s = ServerProcess("--context-length", "1024", "--prefill-buckets", "64",
                      "--graceful-shutdown-timeout", "60", log_path=tmp_path / "log",
                      executor=None if executor == "ray" else "local")  # fmt: skip
    results: list = []
    children = _descendants(s.proc.pid)
    threads = _inflight(s.url, 3, results, 400)
    assert wait_for(lambda: s.metric("capture_service_running_requests") == 3, 30)
    os.kill(s.proc.pid, signal.SIGTERM)
    assert wait_for(lambda: _health(s.url) == 503, 5)
    r = httpx.post(s.url + "/generate", json={"input_ids": [1]}, timeout=10)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    for t in threads:
        t.join(120)
    assert results == [200, 200, 200]  # the in-flight requests finished
    assert s.proc.wait(timeout=60) == 0
    assert wait_for(lambda: not any(_alive(p) for p in children), 20), "processes left behind"
    s.stop()


def test_a_signal_to_the_whole_process_group_still_exits_at_once(tmp_path):
    """``kill -- -PGID`` and systemd's default ``KillMode=control-group`` signal Ray's local
    processes with the server; its shutdown then must not wait on the gone GCS (a minute, then
    Ray aborts the process) but exit 0 in seconds, leaving nothing of the group behind."""
    s = ServerProcess("--context-length", "1024", "--prefill-buckets", "64",
                      log_path=tmp_path / "log", executor=None, new_session=True)  # fmt: skip
    group = os.getpgid(s.proc.pid)
    assert group == s.proc.pid
    started = time.monotonic()
    os.killpg(group, signal.SIGTERM)
    assert s.proc.wait(timeout=60) == 0
    assert time.monotonic() - started < 15, s.log()
    assert "Server stopped (exit code 0)" in s.log()
    assert wait_for(lambda: not _group_members(group), 20), "processes of the group left behind"
    s.stop()


def _group_members(group: int) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if fields[0] != "Z" and int(fields[2]) == group:
            out.append(int(pid))
    return out


def test_a_short_drain_aborts_what_is_left_and_still_exits_zero(tmp_path):
    s = ServerProcess("--context-length", "4096", "--prefill-buckets", "64",
                      "--graceful-shutdown-timeout", "1", log_path=tmp_path / "log")  # fmt: skip
    results: list = []
    threads = _inflight(s.url, 2, results, 3000)
    assert wait_for(lambda: s.metric("capture_service_running_requests") == 2, 30)
    os.kill(s.proc.pid, signal.SIGINT)
    for t in threads:
        t.join(60)
    assert results == [503, 503]
    assert s.proc.wait(timeout=60) == 0
    s.stop()


def test_a_start_up_that_cannot_succeed_exits_non_zero(tmp_path):
    """An unreachable Ray cluster: the process exits non-zero with the reason, not 503 forever."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--port", "0", "--ray-address",
         "127.0.0.1:9", "--startup-timeout", "30"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode != 0
    assert "start-up failed" in out.stdout + out.stderr


def _health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _descendants(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _rank_pids(server_pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(server_pid).children(recursive=True)
            if "RankActor" in " ".join(p.cmdline() or [p.name()])]  # fmt: skip


def test_a_hung_then_dead_rank_is_reported_fails_requests_and_is_rebuilt(tmp_path):
    """Items 3 and 4: a rank stopped mid-step turns /health 503 within the step timeout and
    fails the in-flight request with the reason; the engine is rebuilt (new actors, groups,
    agreement, capture) and serves again; the same after a rank is killed outright."""
    s = ServerProcess("--tp", "2", "--context-length", "4096", "--prefill-buckets", "64",
                      "--step-timeout", "3", "--graceful-shutdown-timeout", "5",
                      log_path=tmp_path / "log", executor=None)  # fmt: skip
    try:
        ranks = _rank_pids(s.proc.pid)
        assert len(ranks) == 2, ranks
        results: list = []
        threads = _inflight(s.url, 1, results, 3000)
        assert wait_for(lambda: s.metric("capture_service_running_requests") == 1, 30)
        os.kill(ranks[1], signal.SIGSTOP)
        t0 = time.monotonic()
        assert wait_for(lambda: _health(s.url) == 503, 10)
        assert time.monotonic() - t0 < 8  # the 3 s step timeout, not the collective timeout
        threads[0].join(30)
        assert results == [500]
        assert s.metric("capture_service_failed_requests_total") == 1
        assert wait_for(lambda: _health(s.url) == 200, 120), s.log()[-3000:]
        assert s.metric("capture_service_engine_restarts_total") == 1
        assert s.metric("capture_service_engine_healthy") == 1
        ok = httpx.post(s.url + "/generate", json={"input_ids": [1, 2]}, timeout=60)
        assert ok.status_code == 200
        new_ranks = _rank_pids(s.proc.pid)
        assert len(new_ranks) == 2 and not set(new_ranks) & set(ranks)
        os.kill(new_ranks[0], signal.SIGKILL)
        assert wait_for(lambda: _health(s.url) == 503, 10)
        assert wait_for(lambda: _health(s.url) == 200, 120), s.log()[-3000:]
        assert s.metric("capture_service_engine_restarts_total") == 2
    finally:
        for pid in _rank_pids(s.proc.pid) if s.proc.poll() is None else []:
            os.kill(pid, signal.SIGCONT)
        s.stop()


def test_health_generate_probes_stay_out_of_the_request_metrics(server):
    """Probes are not user traffic: they leave requests, tokens and latency counts alone."""
    names = ("capture_service_prompt_tokens_total", "capture_service_generated_tokens_total",
             "capture_service_e2e_latency_seconds_count")  # fmt: skip
    before = [server.metric(n) for n in names]
    for _ in range(3):
        assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    assert [server.metric(n) for n in names] == before


def test_a_recorded_ray_cluster_address_is_never_joined(tmp_path):
    """A dead cluster in RAY_ADDRESS (or recorded by an earlier `ray start`) must not capture a
    server that starts its own local Ray: it comes up on its own instance."""
    import subprocess
    import sys

    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9"}
    code = ("from service.executors.ray import ensure_ray; import ray; ensure_ray(None); "
            "print('joined', ray.get_runtime_context().gcs_address); ray.shutdown()")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "joined" in out.stdout and ":9\n" not in out.stdout


def test_a_signal_while_ray_starts_leaves_no_process_behind_and_exits_zero(tmp_path):
    """Ray 2.60's own SIGTERM handlers in ``ray.init`` leave the agents its raylet spawned
    running for good when the signal comes mid-start (seen: four agents left, exit status 15).
    A pod deleted while it starts must stop what Ray started and exit 0, as a drain does."""
    import subprocess
    import sys

    from tests.server_proc import free_port

    log_path = tmp_path / "log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--port", str(free_port())],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    try:
        assert wait_for(lambda: "Starting Ray" in log_path.read_text(), 120), log_path.read_text()
        time.sleep(1.0)  # ray.init takes seconds: the signal comes while it runs
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log_path.read_text()
    assert "start was interrupted" in text and "Server stopped (exit code 0)" in text, text
    assert wait_for(lambda: not _group_members(proc.pid), 20), "Ray processes left behind"
