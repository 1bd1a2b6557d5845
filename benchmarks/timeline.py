"""Where one call's time goes, host and device on one clock (the profiler's CPU and CUDA
activities): how long the host works before the device gets its first op, how long a graph
launch takes on the host, how late the first kernel of a launched graph starts, and how much
of the call the device sits idle.

Used by ``prefill_graphs.py --timeline`` and ``graph_launch.py``, which also share the plain
timings here (CUDA events around a call, the host time to issue one). Times are from profiled calls,
so host times include the profiler's own overhead per recorded op (a few microseconds each);
compare backends within one run, not these against unprofiled event timings.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

STEP = "timeline_step"
GRAPH_LAUNCH = "cudaGraphLaunch"
SHORT_GAP_US = 5.0
LAUNCHES = (GRAPH_LAUNCH, "cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
            "cuLaunchKernel", "cudaMemcpyAsync", "cudaMemsetAsync")  # fmt: skip


@dataclass(frozen=True)
class Timeline:
    """Microseconds from the start of the call (medians over the profiled calls)."""

    host_us: float  # the call's host time, start to return
    first_launch_us: float  # the first launch call (kernel, copy, memset or graph) starts
    graph_launch_start_us: float  # the first graph launch starts (nan: none)
    graph_launch_us: float  # that launch call's host duration (nan: none)
    graph_first_op_lag_us: float  # its launch start -> the first device op after it starts
    first_op_us: float  # the first device op starts
    device_end_us: float  # the last device op ends
    busy_us: float  # device op durations summed
    idle_us: float  # first op -> last op end, minus busy: the device waiting inside the call
    graph_launches: float  # graph launches per call
    # idle split by gap length: many short gaps are launch boundaries the device pays for
    # (graph to kernel, kernel to graph), a few long ones are the device waiting on the host
    short_gaps_us: float = 0.0  # gaps under SHORT_GAP_US, summed
    long_gaps_us: float = 0.0  # gaps of SHORT_GAP_US or more, summed
    long_gaps: float = 0.0  # how many
    # the longest gaps of one call (the call of median idle): "at+len before->after", us
    where: str = ""
    # the front of that call, up to its first attention kernel: the host's launch calls
    # ("name@start+duration") and the device's ops ("name@start+duration"), us from its start;
    # what the host does between two launches is the time between them
    front_host: str = ""
    front_device: str = ""

    def to_json(self) -> dict:
        return {k: round(v, 1) if isinstance(v, float) else v for k, v in asdict(self).items()}


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median milliseconds of ``fn`` (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(3):
        fn()
    return statistics.median(one_call_ms(fn, device) for _ in range(iters))


def one_call_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call: CUDA events around it on GPU, wall clock on CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)


def host_ms(fn, iters: int) -> float:
    """Median milliseconds the host spends issuing one call of ``fn`` from an idle device (the
    call returns when its work is queued, unless it waits on the device inside)."""
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(samples)


def timeline(fn: Callable[[], object], calls: int = 5) -> Timeline:
    """Profile ``calls`` calls of ``fn``, each from an idle device, and place each call's host
    launches and device ops on the profiler's clock."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with record_function(STEP):
                fn()
            torch.cuda.synchronize()
    return summarize(prof.events())


def summarize(events: list) -> Timeline:
    cuda = torch.autograd.DeviceType.CUDA
    steps = sorted((e for e in events if e.name == STEP and e.device_type != cuda),
                   key=lambda e: e.time_range.start)  # fmt: skip
    device = sorted((e for e in events if e.device_type == cuda and e.name != STEP),
                    key=lambda e: e.time_range.start)  # fmt: skip
    launches = sorted((e for e in events if e.name in LAUNCHES and e.device_type != cuda),
                      key=lambda e: e.time_range.start)  # fmt: skip
    rows: list[dict[str, float]] = []
    for i, step in enumerate(steps):
        t0 = step.time_range.start
        # a call's device ops start before the next call does (calls are synchronized)
        t1 = steps[i + 1].time_range.start if i + 1 < len(steps) else float("inf")
        ops = [d for d in device if t0 <= d.time_range.start < t1]
        mine = [c for c in launches if t0 <= c.time_range.start <= step.time_range.end]
        graphs = [c for c in mine if c.name == GRAPH_LAUNCH]
        if not ops:
            continue
        first_op = ops[0].time_range.start
        end = max(d.time_range.end for d in ops)
        busy = sum(d.time_range.end - d.time_range.start for d in ops)
        gaps = device_gaps(ops, t0)
        short = [g for g in gaps if g[1] < SHORT_GAP_US]
        long = [g for g in gaps if g[1] >= SHORT_GAP_US]
        nan = float("nan")
        g = graphs[0] if graphs else None
        after = [d for d in ops if g is not None and d.time_range.start >= g.time_range.start]
        rows.append({
            "host_us": step.time_range.end - t0,
            "first_launch_us": (mine[0].time_range.start - t0) if mine else nan,
            "graph_launch_start_us": (g.time_range.start - t0) if g else nan,
            "graph_launch_us": (g.time_range.end - g.time_range.start) if g else nan,
            "graph_first_op_lag_us": (after[0].time_range.start - g.time_range.start)
            if g and after else nan,
            "first_op_us": first_op - t0,
            "device_end_us": end - t0,
            "busy_us": busy,
            "idle_us": (end - first_op) - busy,
            "graph_launches": float(len(graphs)),
            "short_gaps_us": sum(g[1] for g in short),
            "long_gaps_us": sum(g[1] for g in long),
            "long_gaps": float(len(long)),
            "where": " ".join(f"{at:.0f}+{n:.0f} {a[:18]}->{b[:18]}"
                              for at, n, a, b in sorted(long, key=lambda g: -g[1])[:5]),
            **front(mine, ops, t0),
        })  # fmt: skip
    if not rows:
        raise RuntimeError("the profiler recorded no device ops inside the timed calls")
    median_idle = sorted(rows, key=lambda r: r["idle_us"])[len(rows) // 2]
    text = ("where", "front_host", "front_device")
    return Timeline(
        **{k: statistics.median(r[k] for r in rows) for k in rows[0] if k not in text},
        **{k: str(median_idle[k]) for k in text},
    )


def front(launches: list, ops: list, t0: float) -> dict[str, str]:
    """A call's launches and device ops up to its first attention kernel (at most 16 each)."""
    first_attention = next((d.time_range.start for d in ops if "Prefill" in d.name), None)
    end = ops[min(len(ops), 16) - 1].time_range.start
    if first_attention is not None:
        end = first_attention

    def fmt(events: list, name: Callable[[str], str]) -> str:
        shown = [e for e in events if e.time_range.start <= end][:16]
        return " ".join(
            f"{name(e.name)}@{e.time_range.start - t0:.0f}+"
            f"{e.time_range.end - e.time_range.start:.0f}"
            for e in shown
        )

    return {
        "front_host": fmt(launches, lambda n: n.removeprefix("cuda")),
        "front_device": fmt(ops, lambda n: short_name(n)[:18]),
    }


def device_gaps(ops: list, t0: float) -> list[tuple[float, float, str, str]]:
    """(start from t0, length, op before, op after) of each stretch the device sat idle
    between two of the call's ops (us)."""
    gaps = []
    end, before = ops[0].time_range.end, ops[0].name
    for d in ops[1:]:
        if d.time_range.start > end:
            gaps.append((end - t0, d.time_range.start - end, short_name(before),
                         short_name(d.name)))  # fmt: skip
        if d.time_range.end >= end:
            end, before = d.time_range.end, d.name
    return gaps


def short_name(kernel: str) -> str:
    """A kernel's name without namespaces, templates and arguments."""
    name = kernel.split("<")[0].split("(")[0]
    return name.rsplit("::", 1)[-1] or kernel[:18]


HEADER = (f"{'host':>7} {'1st launch':>10} {'graph at':>8} {'launch':>7} {'lag':>6} "
          f"{'1st op':>7} {'dev end':>8} {'busy':>7} {'idle':>7} {'graphs':>6} "
          f"{'short':>6} {'long':>6} {'n':>3}")  # fmt: skip


def row(t: Timeline) -> str:
    def f(v: float, w: int) -> str:
        return f"{'-':>{w}}" if v != v else f"{v:>{w}.0f}"  # nan: no graph launch

    return " ".join((f(t.host_us, 7), f(t.first_launch_us, 10), f(t.graph_launch_start_us, 8),
                     f(t.graph_launch_us, 7), f(t.graph_first_op_lag_us, 6), f(t.first_op_us, 7),
                     f(t.device_end_us, 8), f(t.busy_us, 7), f(t.idle_us, 7),
                     f(t.graph_launches, 6), f(t.short_gaps_us, 6), f(t.long_gaps_us, 6),
                     f(t.long_gaps, 3)))  # fmt: skip
