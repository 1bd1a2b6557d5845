"""benchmarks/serve.py against a real server: what it counts is what was sent and served."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.server_proc import ServerProcess

ROOT = Path(__file__).resolve().parents[1]


def test_serve_benchmark_counts_what_the_server_did(tmp_path):
    server = ServerProcess("--context-length", "128", "--max-running-requests", "4",
                           "--prefill-buckets", "32,64", "--decode-graphs", "on",
                           log_path=tmp_path / "log")  # fmt: skip
    try:
        out = tmp_path / "result.json"
        run = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--url", server.url,
             "--num-requests", "10", "--input-len", "20", "--output-len", "6",
             "--range-ratio", "0.5", "--concurrency", "3", "--seed", "3",
             "--max-seconds", "120", "--out", str(out)],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert "10/10 requests done" in run.stderr  # progress
        r = json.loads(out.read_text())
    finally:
        server.stop()
    assert r["requests_sent"] == r["requests_ok"] == 10 and r["failures"] == {}
    wanted = sum(j["output_tokens"] for j in r["workload"])
    # every request ran to its length (ignore_eos), and the server counted the same tokens
    assert r["output_tokens"] == wanted == r["server_generated_tokens"]
    assert r["input_tokens"] == sum(j["prompt_tokens"] for j in r["workload"])
    assert r["server_requests_finished"] == 10
    assert r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p50"] > 0
    assert 0 < r["prefill_graph_hit_ratio"] <= 1 and 0 < r["decode_graph_hit_ratio"] <= 1
    assert 0 <= r["prefill_padded_share"] < 1
