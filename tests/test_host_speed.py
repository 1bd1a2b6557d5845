"""benchmarks/host_speed.py reads the kernel's scheduler counters per thread: a thread that spins
beside a waiting main thread is the one charged with the CPU time, and the main thread's own
figures stay its own (a swapped or summed reading would blame the wrong thread in a GPU call's
report, where these numbers decide whether a slow host was contention or the code)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from benchmarks.host_speed import ThreadWatch, host_speed, summary, thread_times

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="scheduler counters need Linux procfs"
)


def test_a_spinning_thread_is_charged_with_its_cpu_time_and_the_waiting_main_thread_is_not():
    tid: list[int] = []
    done = threading.Event()

    def spin() -> None:
        tid.append(threading.get_native_id())
        while not done.is_set():
            pass

    worker = threading.Thread(target=spin)
    watch = ThreadWatch().start()
    worker.start()
    time.sleep(0.3)  # the main thread off CPU; the spinner holds the GIL between switches
    got = watch.stop()  # while the spinner lives: an ended thread's counters are gone
    done.set()
    worker.join(timeout=5)
    assert got["available"] and got["wall_ms"] >= 290
    spinner = [t for t in got["others"] if t["tid"] == tid[0]]
    assert spinner and spinner[0]["on_cpu_ms"] > 150
    assert got["main"]["on_cpu_ms"] < 100
    assert "others ran" in summary(got)


def test_the_counters_of_this_process_s_threads_include_the_main_thread():
    times = thread_times()
    main = times[threading.get_native_id()]
    assert main.on_cpu_ns > 0 and main.slices > 0


def test_host_speed_times_the_python_loop_and_says_where_it_ran():
    speed = host_speed(torch.device("cpu"), reps=3)
    assert speed["python_loop_us"] > 0
    assert speed["cpus_allowed"] >= 1 and speed["cpu"] >= 0
    assert "kernel_launch_us" not in speed  # no CUDA device: no launch to time
