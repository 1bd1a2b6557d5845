"""The GPU benchmark scripts still run end to end on the built-in model (``--tiny``, CPU), so a
GPU call is not the first place an API change to the service or to a shared helper breaks them
(``decode_step.py`` failed on a changed ``device_rates`` signature until session 29 noticed).
They report the kernel choices that their figures depend on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_decode_step_runs_and_reports_its_kernels(tmp_path):
    out = tmp_path / "decode.json"
    proc = run_script("benchmarks/decode_step.py", "--tiny", "--batches", "1,2", "--iters", "2",
                      "--gate-up-kernel", "torch", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert (
        got["gate_up_kernel"]["name"] == "torch" and "asked for" in got["gate_up_kernel"]["reason"]
    )
    assert got["fused_kernels"]["name"] == "torch"
    assert [r["batch"] for r in got["rows"]] == [1, 2]
    assert all(r["graph_ms"] > 0 and r["eager_ms"] > 0 for r in got["rows"])


def test_prefill_graphs_runs_every_backend_and_reports_its_kernels(tmp_path):
    out = tmp_path / "prefill.json"
    proc = run_script("benchmarks/prefill_graphs.py", "--tiny", "--buckets", "16,64",
                      "--iters", "2", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["gate_up_kernel"]["name"] == "torch"
    assert "CUDA device" in got["gate_up_kernel"]["reason"]
    assert sorted({r["bucket"] for r in got["rows"]}) == [16, 64]
    for row in got["rows"]:
        for backend in ("full", "breakable", "tc_piecewise"):
            assert row[f"{backend}_ms"] > 0
            assert row[f"{backend}_maxdiff"] < 1e-3  # fp32 on CPU: the replay matches eager
