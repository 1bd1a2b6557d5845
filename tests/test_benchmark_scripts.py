"""The GPU benchmark scripts still run end to end on the built-in model (``--tiny``, CPU), so a
GPU call is not the first place an API change to the service or to a shared helper breaks them
(``decode_step.py`` failed on a changed ``device_rates`` signature until session 29 noticed).
They report the kernel choices that their figures depend on."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_decode_step_runs_and_reports_its_kernels(tmp_path):
    out = tmp_path / "decode.json"
    proc = run_script("benchmarks/decode_step.py", "--tiny", "--batches", "1,2", "--iters", "2",
                      "--gate-up-kernel", "torch", "--rope-store-kernel", "torch",
                      "--splitk-norm-kernel", "torch", "--copy-ab", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert (
        got["gate_up_kernel"]["name"] == "torch" and "asked for" in got["gate_up_kernel"]["reason"]
    )
    # the copy A/B: both arms timed and printed
    assert all(r["graph_ms_ab"] > 0 and r["graph_ms_per_field_copy"] > 0 for r in got["rows"])
    assert "decode copy A/B" in proc.stdout
    assert got["fused_kernels"]["name"] == "torch"
    assert "asked for" in got["rope_store_kernel"]["reason"]
    assert "asked for" in got["splitk_norm_kernel"]["reason"]
    assert [r["batch"] for r in got["rows"]] == [1, 2]
    assert all(r["graph_ms"] > 0 and r["eager_ms"] > 0 for r in got["rows"])


def test_prefill_graphs_runs_every_backend_and_reports_its_kernels(tmp_path):
    out = tmp_path / "prefill.json"
    proc = run_script("benchmarks/prefill_graphs.py", "--tiny", "--buckets", "16,64",
                      "--iters", "2", "--host-steps", "64", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["gate_up_kernel"]["name"] == "torch"
    assert "CUDA device" in got["gate_up_kernel"]["reason"]
    assert got["rope_store_kernel"]["name"] == "torch"
    assert "CUDA device" in got["rope_store_kernel"]["reason"]
    assert got["splitk_norm_kernel"]["name"] == "torch"
    assert "CUDA device" in got["splitk_norm_kernel"]["reason"]
    assert sorted({r["bucket"] for r in got["rows"]}) == [16, 64]
    for row in got["rows"]:
        for backend in ("full", "breakable", "tc_piecewise"):
            assert row[f"{backend}_ms"] > 0
            assert row[f"{backend}_maxdiff"] < 1e-3  # fp32 on CPU: the replay matches eager
            # the host's speed beside each timing: one loop per paired round (four), the main
            # thread's scheduler counters over the window
            threads = row[f"{backend}_threads"]
            assert len(threads["python_loop_us"]) == 4 and min(threads["python_loop_us"]) > 0
            assert threads["available"] and threads["main"]["on_cpu_ms"] > 0
    assert set(got["host_speed"]) == {"start", "full", "breakable", "tc_piecewise"}
    assert "this process's host" in proc.stdout
    # the segment backends' host steps at 64 tokens, waited for in the driver and in a Python
    # loop, each printed
    steps = {r["bucket"]: r for r in got["rows"]}[64]
    for backend, label in (("breakable", "breakabl poll"), ("tc_piecewise", "tc_piece poll")):
        for key in (f"{backend}_host_steps", f"{backend}_host_steps_poll"):
            assert steps[key]["first_attention_us"] > 0, key
        assert re.search(rf"^ *{label} +64 ", proc.stdout, re.M), label


def test_schedule_ab_times_two_ranks_of_one_process_and_checks_their_logits_agree(tmp_path):
    out = tmp_path / "ab.json"
    proc = run_script("benchmarks/schedule_ab.py", "--tiny", "--arms", "own,own", "--buckets",
                      "16,64", "--iters", "4", "--rounds", "2", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["arms"] == ["own#1", "own#2"]  # an A/A run: two ranks, labelled apart
    assert got["field"] == "prefill_schedule"
    assert got["reasons"]["own#2"] == "asked for (--prefill-schedule own)"
    assert [r["bucket"] for r in got["rows"]] == [16, 64]
    for row in got["rows"]:
        assert row["logits_equal"]  # the same seed, the same weights, the same schedule
        assert len(row["own#1_samples"]) == len(row["own#2_samples"]) == 4
        assert row["own#1_ms"] > 0 and len(row["python_loop_us"]) == 2


def test_schedule_ab_refuses_a_tweak_that_cannot_apply_here():
    """--tweak changes the second arm's rank only; a tweak whose kernel or plan this rank does
    not have (the built-in model on CPU) says so instead of timing two equal arms."""
    for tweak, why in (("small_plans_on_device", "needs a segment backend's balanced plan"),
                       ("bias_in_rope", "needs the rotary + K/V store kernel"),
                       ("bias_in_gemm", "needs the rotary + K/V store kernel")):  # fmt: skip
        bad = run_script("benchmarks/schedule_ab.py", "--tiny", "--tweak", tweak, "--buckets",
                         "16", "--iters", "2", "--rounds", "2")  # fmt: skip
        assert bad.returncode != 0 and why in bad.stderr


def test_idle_report_splits_saved_calls_into_device_work_and_waiting():
    """The script that docs/benchmarks.md quotes for where the 2,048-token miss lies: it reads
    saved results, so it runs here on a GPU call's own output. A report that lost the busy time
    or mislabelled a gap would change these figures (s29 D: `full` at 2,048 tokens was 10.267
    ms, 9.735 of them device work)."""
    saved = ROOT / "docs/results/prefill-2026-12-04-s29-d-34c47a6.json"
    timed = ROOT / "docs/results/prefill-2026-12-04-s28b-36ce911.json"
    proc = run_script("benchmarks/idle_report.py", str(saved), str(timed))
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(
        x for x in proc.stdout.splitlines() if "s29-d" in x and " 2048 " in x and "full" in x
    )
    assert line.split()[3:8] == ["10.267", "9.735", "0.532", "1.42", "1.35"]
    # s28 B's 16-token `full` call waited three times for the host before layer 0's attention
    text = proc.stdout.split("profiled calls", 1)[1]
    block = text.split("s28b-36ce911.json             16         full", 1)[1].split(".json", 1)[0]
    assert "72.0 at   62.0: elementwise_kernel -> Memcpy HtoD" in block
    assert "64.0 at  135.0: Memcpy HtoD -> Memcpy HtoD" in block
    assert "55.0 at  200.0: Memcpy HtoD -> void at::native::(" in block


def test_idle_report_says_what_to_change_for_a_wrong_argument(tmp_path):
    proc = run_script("benchmarks/idle_report.py", str(tmp_path / "missing.json"))
    assert proc.returncode == 2 and "no such results file" in proc.stderr
    saved = ROOT / "docs/results/prefill-2026-12-04-s29-d-34c47a6.json"
    proc = run_script("benchmarks/idle_report.py", str(saved), "--runners", "full,ful")
    assert proc.returncode == 2 and "unknown runners ['ful']" in proc.stderr


def test_the_targets_check_holds_each_backend_to_the_issue_s_lines():
    """`benchmarks/targets.py` decides met or missed for every run from now on. A check that
    compared with the wrong floor, let a tie with HF pass, or dropped the eager comparison would
    misreport; so would one that read the wrong bucket's target (3x applies up to 256 tokens,
    1.4x from 2,048, neither between)."""
    from benchmarks.targets import from_result, verdicts

    rows = [
        {"bucket": 256, "floor_ms": 2.0, "floor_burst_ms": 1.0,  # the burst floor is the one
         "full_ms": 3.0, "full_eager_ms": 9.0, "breakable_ms": 3.01, "breakable_eager_ms": 3.0},
        {"bucket": 1024, "floor_burst_ms": 1.0, "full_ms": 5.0, "full_eager_ms": 6.0},
        {"bucket": 2048, "floor_burst_ms": 10.0, "full_ms": 14.0, "full_eager_ms": 20.0},
    ]  # fmt: skip
    got = {(v.backend, v.bucket, v.target): (round(v.measured, 3), v.met)
           for v in verdicts(rows, ["full", "breakable"], {1024: 5.0})}  # fmt: skip
    assert got == {
        ("full", 256, "<= 3x floor"): (3.0, True),
        ("full", 256, "<= 1x eager"): (0.333, True),
        ("breakable", 256, "<= 3x floor"): (3.01, False),
        ("breakable", 256, "<= 1x eager"): (1.003, False),
        ("full", 1024, "< 1x HF compiled"): (1.0, False),  # a tie is not faster
        ("full", 1024, "<= 1x eager"): (0.833, True),
        ("full", 2048, "<= 1.4x floor"): (1.4, True),
        ("full", 2048, "<= 1x eager"): (0.7, True),
    }
    # a GPU call's saved result: session 31's call B, where breakable missed 3x at 256 tokens
    saved = json.loads((ROOT / "docs/results/prefill-ab-2026-12-05-s31-b-triton.json").read_text())
    missed = [(v.backend, v.bucket, round(v.measured, 2)) for v in from_result(saved) if not v.met]
    assert missed == [("breakable", 256, 3.06)]


def test_the_targets_check_marks_timings_taken_while_the_host_ran_slow():
    """The lent VMs' CPUs run at one of two speeds, and the host-bound small buckets follow
    them (docs/benchmarks.md, session 50). A miss must stay a miss, but the report must say
    which timings ran on the slow host: by the process's own fastest loop, not a fixed figure,
    and only where the result recorded the loop."""
    from benchmarks.targets import from_result, report, verdicts

    rows = [
        {"bucket": 256, "floor_burst_ms": 1.0, "full_ms": 2.9, "breakable_ms": 3.1,
         "full_threads": {"python_loop_us": [40.0, 41.0, 44.0, 42.0]},
         "breakable_threads": {"python_loop_us": [70.0, 75.0, 41.0, 80.0]}},
        {"bucket": 2048, "floor_burst_ms": 10.0, "full_ms": 13.0, "breakable_ms": 13.5},
    ]  # fmt: skip
    vs = {(v.backend, v.bucket): v for v in verdicts(rows, ["full", "breakable"], {})}
    slow, fast = vs[("breakable", 256)], vs[("full", 256)]
    assert not slow.met and slow.slow_host and slow.host_loop_us == (70.0, 75.0, 41.0, 80.0)
    assert fast.met and not fast.slow_host
    assert not vs[("full", 2048)].slow_host and vs[("full", 2048)].host_loop_us == ()
    text = report(list(vs.values()))
    assert "3.10  MISSED  loop 70/75/41/80 us, slow host" in text
    assert "missed: breakable 256 (<= 3x floor: 3.10, slow host)" in text
    # session 50's H200 table: its one miss came while the host ran slow
    saved = json.loads(
        (ROOT / "docs/results/prefill-table-2026-12-07-s50-c-92bd060.json").read_text()
    )
    missed = [(v.backend, v.bucket, round(v.measured, 2), v.slow_host)
              for v in from_result(saved) if not v.met]  # fmt: skip
    assert missed == [("tc_piecewise", 256, 3.12, True)]


@pytest.mark.parametrize("backend", ["breakable", "tc_piecewise"])
def test_host_steps_times_a_real_replay_of_the_bucket(backend):
    """``benchmarks/host_steps.py`` splits a segment runner's replay into its host steps (the
    token copy, the first launch, the plan, each launch). Its figures mean something only if the
    steps it times are the replay: after it, the bucket's output buffer holds this batch's
    forward (eager's result) and every graph counted one replay per timed or warm-up call. A
    timer that skipped the attention launches or a graph would leave other numbers there."""
    from benchmarks.host_steps import host_steps
    from service.buckets import decide_replay
    from service.engine import Engine
    from tests.batches import live_batch
    from tests.test_honest_replay import graph_cfg

    e = Engine(graph_cfg(backend))
    w = e.executor.worker
    lens = (37, 60, 11)
    batch = live_batch(w, lens, seed=5)
    decision = decide_replay(e.resolved.plan, sum(lens), len(lens))
    bucket = decision.bucket
    calls = w.runner.captured_calls(bucket)
    with torch.inference_mode():
        want = w.eager_runner.run(batch, decision).clone()
        got = host_steps(w.runner, batch, bucket, iters=3)
        tape = w.runner._captured[bucket]
        tape = getattr(tape, "tape", tape)
        out = tape.result[: batch.num_tokens]
        assert torch.equal(out, want)
    assert got is not None
    assert [c.replays for c in calls] == [5] * len(calls)  # 3 timed, 2 warm-up
    layers = w.model.cfg.num_hidden_layers
    assert got["steps"] == 2 * layers  # after the first graph: an attention and a graph a layer
    for key in ("load_us", "head_us", "plan_us", "attention_launch_us", "graph_launch_us"):
        assert got[key] > 0, key
    assert got["first_attention_us"] >= got["load_us"] + got["head_us"] + got["plan_us"]
    assert got["total_us"] >= got["first_attention_us"]
    assert host_steps(w.eager_runner, batch, bucket) is None  # no tape: nothing to split


def test_line_costs_finds_the_line_of_the_plan_that_takes_the_time():
    """``host_steps.line_costs`` (the GPU call's line-by-line plan step) traces the planned
    path's prepare and the replan's call while the replay resolves its launches. Its output means
    something only if the time lands on the line that spent it: here the module's plan (a
    stand-in that sleeps 2 ms, far above any traced line) must come first, at its own line."""
    import time
    from types import SimpleNamespace as NS

    import numpy as np

    from benchmarks.host_steps import line_costs, plan_only_runner
    from tests.test_flashinfer_replan import replan

    r = replan()[0]
    r(np.array([40, 24, 0, 0]))  # the first plan: the module call recorded
    call = r._call
    r._call = lambda: (time.sleep(0.002), call())[1]
    runner = plan_only_runner(r, np.array([200, 56, 0, 0]), 4)
    got = line_costs(runner, None, 256, iters=5, top=3)
    assert got[0][0].startswith("prepare:") and got[0][1] >= 2000  # inclusive of the replan
    assert got[1][0].startswith("__call__:") and "self._call()" in got[1][0] and got[1][1] >= 2000
    assert got[2][1] < 1000  # no other line near it
    assert line_costs(NS(_captured={}), None, 256) == []  # nothing captured: nothing traced


def test_the_host_waits_as_asked_and_refuses_an_unknown_wait():
    from benchmarks.host_steps import waiter

    assert waiter(torch.device("cpu"), "poll")() is None  # no device to wait for
    assert waiter(torch.device("cuda"), "sync") is torch.cuda.synchronize
    with pytest.raises(ValueError, match="wait must be 'sync' or 'poll', not 'spin'"):
        waiter(torch.device("cpu"), "spin")


def test_replan_ops_times_each_op_it_prints_on_a_stand_in_cuda_runner(monkeypatch):
    """``host_steps.replan_ops`` runs only on CUDA, inside a GPU call that a crash there would
    waste; here its ops run on a CPU replan with CUDA's synchronize, stream and event stood in:
    every key the printed row names comes back, and the replan still plans (its indptrs are the
    last plan's)."""
    from types import SimpleNamespace as NS

    import numpy as np

    from benchmarks.host_steps import ops_row, replan_ops
    from tests.test_flashinfer_replan import offsets, replan

    r = replan()[0]
    r(np.array([40, 24, 0, 0]))
    recorded: list[object] = []
    r._copied = NS(record=lambda stream=None: recorded.append(stream), synchronize=lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: "stream")
    sleeps: list[int] = []
    monkeypatch.setattr(torch.cuda, "_sleep", sleeps.append)
    queries: list[bool] = []

    class Event:  # done at its second query: the poll must loop until then
        def record(self) -> None:
            self.asked = 0

        def query(self) -> bool:
            self.asked += 1
            queries.append(self.asked > 1)
            return self.asked > 1

    monkeypatch.setattr(torch.cuda, "Event", Event)
    heads: list[int] = []
    tape = NS(_head=[lambda: heads.append(1)], graphs=[])
    runner = NS(attention=NS(planned=NS(_replans={(256, "shape"): r, (512, "shape"): None})),
                device=NS(type="cuda"), _captured={256: tape})  # fmt: skip
    got = replan_ops(runner, 256, iters=3)
    row = ops_row(got)
    for key in got:
        assert key.removesuffix("_us") in row.replace(" ", "_"), key
    assert {"mark_after_module_us", "mark_after_head_us", "python_after_sync_us",
            "python_after_busy_sync_us", "python_after_busy_poll_us",
            "copy_after_launches_sync_us", "copy_after_launches_poll_us"} <= set(got)  # fmt: skip
    # two busy pairs sleep each round (one waits in the driver, one polls) and two pairs poll
    # (after the sleep, after the launches): as many polls as sleeps, each looping till done
    assert sleeps and queries.count(True) == len(sleeps)
    assert len(heads) > 56  # the launches pairs launched the first segment 56 times a round
    assert queries.count(False) == queries.count(True)
    assert heads and "stream" in recorded  # the head launched, the mark given its stream
    assert r.indptrs.tolist() == [offsets([40, 24, 0, 0])] * 2


def test_the_gpu_call_runs_every_test_file_that_has_gpu_tests():
    """``gpu_run.sh tests`` names its test files (the Ray wheels do not travel to the GPU
    machine, so it cannot collect the whole folder): a new file of ``gpu``-marked tests left out
    of that list would skip on CPU and never run on a GPU either, as three files did until
    session 53."""
    script = (ROOT / "benchmarks" / "gpu_run.sh").read_text()
    default = script.split("${GPU_TESTS:-", 1)[1].split("}", 1)[0]
    listed = set(default.replace("\\", " ").split())
    marked = {
        f"tests/{p.name}"
        for p in (ROOT / "tests").glob("test_*.py")
        if re.search(r"(@|marks=|pytestmark = \[?)pytest\.mark\.gpu\b", p.read_text())
    }
    assert marked, "no test file has gpu-marked tests: the pattern above is stale"
    assert marked <= listed, f"gpu_run.sh tests leaves out {sorted(marked - listed)}"


def test_host_costs_times_the_replan_and_the_token_copy_it_names():
    """``host_costs.py replan``, ``load`` and ``tracer`` (the dev-CPU figures docs/benchmarks.md
    quotes) still run; ``load`` counts one device op for a batch under its bucket (or decode
    size) of the same size as the last (a pad written every time reads 2, or 8 for decode),
    and ``tracer`` finds the traced line of a Python-heavy callee dearer than the call
    untraced (what it measures)."""
    for what in ("replan", "load", "tracer"):
        proc = run_script("benchmarks/host_costs.py", what)
        assert proc.returncode == 0, proc.stderr[-2000:]
        if what == "replan":
            assert re.search(r"replan, 8 slots: [\d.]+ us", proc.stdout), proc.stdout
        elif what == "tracer":
            got = re.findall(r"(.+): untraced +([\d.]+) us, its line traced +([\d.]+) us",
                             proc.stdout)  # fmt: skip
            assert [name.strip() for name, _, _ in got] == [
                "the module call alone", "with torch's device lookup"], proc.stdout  # fmt: skip
            assert float(got[1][2]) > float(got[1][1]), proc.stdout
        else:
            got = re.findall(r"(copy_tokens|decode copy_from), (\d+) .*: [\d.]+ us .*, (\d+) "
                             r"device ops", proc.stdout)  # fmt: skip
            assert got == [("copy_tokens", "200", "1"), ("copy_tokens", "256", "1"),
                           ("decode copy_from", "3", "1"), ("decode copy_from", "4", "1")], (
                proc.stdout)  # fmt: skip
