"""The `plan` command as a user runs it: a real subprocess, JSON out, exit 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args], capture_output=True, text=True, timeout=60
    )


def test_plan_json_seed_case():
    out = run_cli(
        "plan",
        "--backend",
        "full",
        "--context-length",
        "2048",
        "--max-running-requests",
        "8",
        "--prefill-buckets",
        "4096,16384",
        "--full-request-slots",
        "4",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["backend"] == "full"
    assert plan["capture_request_capacity"] == 4
    assert plan["max_capture_tokens"] == 8192
    assert plan["buckets"] == [{"num_tokens": 4096, "capture_seq_lens": [2048, 2048, 0, 0]}]
    assert plan["dropped"][0]["num_tokens"] == 16384
    assert plan["disabled_reason"] is None


def test_plan_table_and_disabled():
    out = run_cli(
        "plan",
        "--backend",
        "tc_piecewise",
        "--context-length",
        "100",
        "--max-running-requests",
        "2",
        "--prefill-buckets",
        "4096",
    )
    assert out.returncode == 0
    assert "disabled: no legal prefill bucket for backend tc_piecewise" in out.stdout
    assert "context_length 100" in out.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--context-length", "0"), "must be a positive integer"),
        (("--max-running-requests", "-3"), "must be a positive integer"),
        (("--backend", "magic"), "invalid choice"),
        (("--prefill-buckets", "4096,abc"), "is not an integer"),
        (("--prefill-buckets", "4096,-1"), "positive"),
        (("--full-request-slots", "20", "--backend", "full"), "--full-request-slots"),
    ],
)
def test_plan_bad_arguments_exit_2_with_a_message(args, needle):
    out = run_cli("plan", *args)
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
