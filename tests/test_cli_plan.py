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


def test_plan_says_which_defaults_it_assumed_and_matches_a_cpu_server():
    """With no sizes given, plan states its assumptions; --device cpu plans what `serve` on a
    CPU machine captures (buckets up to the CPU chunk of 2048, not 8192)."""
    out = run_cli("plan", "--json")
    plan = json.loads(out.stdout)
    assert set(plan["assumed_defaults"]) == {"context_length", "max_running_requests",
                                             "chunked_prefill_size"}  # fmt: skip
    assert max(b["num_tokens"] for b in plan["buckets"]) == 8192
    cpu = json.loads(
        run_cli("plan", "--device", "cpu", "--context-length", "4096", "--json").stdout
    )
    assert max(b["num_tokens"] for b in cpu["buckets"]) == 2048 and len(cpu["buckets"]) == 15
    assert "context_length" not in cpu["assumed_defaults"]
    text = run_cli("plan").stdout
    assert "assumed defaults" in text and "--device cpu" in text
