"""How fast this process's host runs, and what else ran beside its main thread while it was timed.

Why: session 48's timelines showed every host step of the processes that ran the balanced schedule
1.4-1.5x slower than those of the processes that ran FlashInfer's (the same code before any plan,
driver calls such as the graph launch included), and the eager forward's host time ranged 9-21 ms
from process to process. Two readings predict different things:

- the main thread shares its CPU (a thread of its own process, or another process, runs when it
  wants to): the kernel's scheduler counts it as time waiting in the run queue, and the other
  thread's time on a CPU grows (``ThreadWatch``, from ``/proc/self/task/*/schedstat``);
- the same work simply runs slower in that process (placement, caches, the CPU's clock): fixed
  pieces of host work, a pure-Python loop and one tiny kernel or graph launch, take longer
  (``host_speed``), with no waiting in the run queue.

Linux only (procfs); elsewhere the watch reports nothing and says so.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

TASKS = Path("/proc/self/task")


@dataclass(frozen=True)
class ThreadTime:
    name: str
    on_cpu_ns: int  # time this thread ran on a CPU
    waiting_ns: int  # time it was runnable but waited in a run queue
    slices: int  # times it was put on a CPU
    involuntary: int  # context switches forced on it (preempted), from its status


def thread_times() -> dict[int, ThreadTime]:
    """Every thread of this process: {tid: its scheduler counters}; {} without procfs."""
    out: dict[int, ThreadTime] = {}
    if not TASKS.is_dir():
        return out
    for task in TASKS.iterdir():
        try:
            on_cpu, waiting, slices = (int(v) for v in (task / "schedstat").read_text().split())
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except (OSError, ValueError):
            continue  # the thread ended, or the kernel keeps no schedstat
        invol = next(
            (int(line.split()[1]) for line in status.splitlines()
             if line.startswith("nonvoluntary_ctxt_switches")), 0,
        )  # fmt: skip
        out[int(task.name)] = ThreadTime(name, on_cpu, waiting, slices, invol)
    return out


def steal_ticks() -> dict[str, int]:
    """{"cpu": all CPUs, "cpuN": one CPU}: the time (USER_HZ ticks) the hypervisor ran something
    else while this guest's CPU wanted to run (/proc/stat's steal column); {} without it."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        if not line.startswith("cpu"):
            break
        f = line.split()
        if len(f) > 8:
            out[f[0]] = int(f[8])
    return out


class ThreadWatch:
    """Scheduler counters of every thread between ``start()`` and ``stop()``: the main thread's
    waiting in the run queue and forced switches, and the CPU time every other thread took
    (threads alive at ``stop()``: an ended thread's counters leave procfs with it)."""

    def __init__(self) -> None:
        self._before: dict[int, ThreadTime] = {}
        self._steal: dict[str, int] = {}
        self._t0 = 0.0
        self.main = threading.get_native_id()

    def start(self) -> ThreadWatch:
        self._before = thread_times()
        self._steal = steal_ticks()
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> dict:
        wall = time.perf_counter() - self._t0
        after = thread_times()
        if not after:
            return {"available": False}
        others = []
        main: dict = {}
        for tid, now in after.items():
            was = self._before.get(tid, ThreadTime(now.name, 0, 0, 0, 0))
            delta = {
                "on_cpu_ms": (now.on_cpu_ns - was.on_cpu_ns) / 1e6,
                "waiting_ms": (now.waiting_ns - was.waiting_ns) / 1e6,
                "involuntary": now.involuntary - was.involuntary,
            }
            if tid == self.main:
                main = delta
            elif delta["on_cpu_ms"] >= 0.05:
                others.append({"name": now.name, "tid": tid, **delta})
        others.sort(key=lambda t: -t["on_cpu_ms"])
        steal = steal_ticks()
        stolen = {k: (v - self._steal[k]) * 10.0 for k, v in steal.items() if k in self._steal}
        worst = max((v for k, v in stolen.items() if k != "cpu"), default=None)
        return {"available": True, "wall_ms": wall * 1e3, "main": main, "others": others,
                "threads": len(after), "steal_ms_all_cpus": stolen.get("cpu"),
                "steal_ms_max_cpu": worst}  # fmt: skip


def summary(watch: dict, top: int = 3) -> str:
    """One line of a ``ThreadWatch.stop()`` result."""
    if not watch.get("available"):
        return "no scheduler counters (not Linux)"
    m = watch["main"]
    line = (
        f"main thread {m.get('on_cpu_ms', 0):.0f} ms on CPU of {watch['wall_ms']:.0f} wall, "
        f"{m.get('waiting_ms', 0):.1f} ms waiting to run, {m.get('involuntary', 0)} preempted; "
        f"{watch['threads']} threads"
    )
    if watch.get("steal_ms_all_cpus") is not None:
        line += (
            f"; stolen by the hypervisor {watch['steal_ms_all_cpus']:.0f} ms over all CPUs "
            f"({watch['steal_ms_max_cpu']:.0f} ms on the worst)"
        )
    others = watch["others"][:top]
    if others:
        line += "; others ran: " + ", ".join(f"{t['name']} {t['on_cpu_ms']:.1f} ms" for t in others)
    return line


def _median_us(fn, reps: int, inner: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter_ns() - t0) / inner / 1e3)
    return statistics.median(samples)


def _python_work() -> int:
    total = 0
    for i in range(1000):
        total += i * i
    return total


def python_loop_us(reps: int = 5, inner: int = 1) -> float:
    """The median µs of the pure-Python loop over ``reps`` timings of ``inner`` loops each (the
    defaults: about 0.2-0.5 ms of the host's time per call)."""
    return _median_us(_python_work, reps, inner)


def current_cpu() -> int:
    """The CPU the calling thread last ran on (procfs; OSError elsewhere)."""
    return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])


def host_speed(device: torch.device, reps: int = 30) -> dict:
    """Median µs of fixed host work in this process: a pure-Python loop (1,000 multiply-adds),
    one tiny kernel launch and one replay of a one-kernel CUDA graph (both from an idle device,
    launch time only), and where the main thread runs (CPU number, CPUs allowed, load)."""
    out: dict = {"python_loop_us": python_loop_us(reps, 20)}
    try:
        out["cpu"] = current_cpu()
        out["cpus_allowed"] = len(os.sched_getaffinity(0))
        out["loadavg"] = Path("/proc/loadavg").read_text().split()[0]
    except (OSError, AttributeError, IndexError, ValueError):
        pass
    if device.type != "cuda":
        return out
    x = torch.zeros(1, device=device)
    torch.cuda.synchronize(device)

    def launch_burst() -> None:
        for _ in range(8):
            x.add_(1)

    out["kernel_launch_us"] = _median_us(launch_burst, reps, 1) / 8
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        x.add_(1)  # warm the kernel outside the capture
        torch.cuda.synchronize(device)
        with torch.cuda.graph(graph, stream=stream):
            x.add_(1)
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        graph.replay()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize(device)
    out["graph_launch_us"] = statistics.median(samples)
    return out


def speed_line(speed: dict) -> str:
    parts = [f"python loop {speed['python_loop_us']:.1f} us"]
    if "kernel_launch_us" in speed:
        parts.append(f"kernel launch {speed['kernel_launch_us']:.1f} us")
        parts.append(f"graph launch {speed['graph_launch_us']:.1f} us")
    if "cpu" in speed:
        parts.append(f"on CPU {speed['cpu']} of {speed['cpus_allowed']}, load {speed['loadavg']}")
    return ", ".join(parts)
