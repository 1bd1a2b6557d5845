"""Where a segment runner's host time goes in one replay, without the profiler.

Why: the profiler's timelines (``timeline.py``) add a few microseconds to every recorded op, so
their host figures for the front of a replay (the token copy, the first segment's launch, the
attention plan, the first attention launch) overstate it, and the unprofiled host issue time
(``host_ms``) is one number. This replays a ``breakable`` or ``tc_piecewise`` bucket step by step
as the runner does (``Tape.run``: the token rows in, the steps before the first attention call,
this forward's attention launches, then the rest in order) with a wall-clock stamp around each
step, from an idle device, and reports medians:

- ``load_us``: the live batch into the static buffers (the token copy);
- ``head_us``: the steps before the first attention call (the first segment's graph launch);
- ``plan_us``: this forward's attention launches resolved (the plan of the planned path, or the
  eager backend's bind), of which ``plan_module_us`` is FlashInfer's compiled plan call, when the
  planned path records one, ``prepare_us`` the replans (the plan less the launchers' lookup),
  and within them ``hooks_act_us`` / ``graph_plan_us`` / ``device_plan_us`` / ``after_us`` the
  balanced schedule's hooks (whether any acts on this plan; the planner graph and planner asked
  before the module plan, the look at its schedule after; ``hooks_us`` all together) and
  ``replan_rest_us`` the replans' own work;
- ``attention_launch_us`` / ``graph_launch_us``: one attention launch / one graph launch, the
  median over the layers, and ``copy_us`` for any other step;
- ``total_us``: the replay's host time, start to return (the steps and the stamps).

The device runs while this is measured (each step is a real launch), so a launch that waits on
a full launch queue shows here; the stamps themselves cost well under a microsecond each.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

ns = time.perf_counter_ns


def waiter(device: torch.device, wait: str) -> Callable[[], None]:
    """How the host waits for the device between replays: ``sync`` in the driver
    (``torch.cuda.synchronize``, as the engine's per-step copy of the sampled ids waits), or
    ``poll``: an event recorded and queried in a Python loop until done, the host thread running
    Python all along (whether a replay's front is slow because of how the host waited)."""
    if wait not in ("sync", "poll"):
        raise ValueError(f"wait must be 'sync' or 'poll', not {wait!r}")
    if device.type != "cuda":
        return lambda: None
    if wait == "sync":
        return torch.cuda.synchronize

    def poll() -> None:
        done = torch.cuda.Event()
        done.record()
        while not done.query():
            pass

    return poll


def _replan_timer(runner: Any, bucket: int, name: str) -> tuple[list[int], Callable[[], None]]:
    """Wrap one callable of each of the planned path's replans of ``bucket`` to time its calls;
    the samples (ns) and the undo. ``_call``: the recorded FlashInfer module plan;
    ``_hooks_act``: whether the schedule's hooks act on this plan (where not, none of the others
    is asked); ``_graph_plan`` / ``_device_plan``: the schedule's planner graph / planner, each
    asked first (and declining where the plan has at most an item per CTA); ``_after``: the
    schedule's look at the plan FlashInfer made."""
    samples: list[int] = []
    undo = [
        _timer(replan, name, samples)[1]
        for replan in _replans(runner, bucket)
        if getattr(replan, name, None) is not None
    ]

    def restore() -> None:
        for one in undo:
            one()

    return samples, restore


def _timer(
    obj: Any, name: str, samples: list[int] | None = None
) -> tuple[list[int], Callable[[], None]]:
    """Wrap ``obj.name`` (a bound method, or a callable kept as an instance attribute) to time
    each call into ``samples`` (ns; a new list if not given); the samples and the undo, which
    puts back what the instance held. Nothing wrapped where ``obj`` is None."""
    samples = [] if samples is None else samples
    if obj is None or not hasattr(obj, name):
        return samples, lambda: None
    inner = getattr(obj, name)
    own = name in vars(obj)  # an instance attribute (else a method the wrapper shadows)

    def timed(*a: Any, **k: Any) -> Any:
        t = ns()
        try:
            return inner(*a, **k)
        finally:
            samples.append(ns() - t)

    def undo() -> None:
        if own:
            setattr(obj, name, inner)
        else:
            delattr(obj, name)

    setattr(obj, name, timed)
    return samples, undo


def _planned(runner: Any) -> Any:
    """The runner's planned attention path (FlashInfer's graph wrappers), or None."""
    return getattr(getattr(runner, "attention", None), "planned", None)


def _tape(runner: Any, bucket: int) -> Any:
    """The replay tape of ``bucket`` (None where the runner keeps none: ``full``, eager)."""
    captured = getattr(runner, "_captured", {}).get(bucket)
    return getattr(captured, "tape", captured)


def _tail(tape: Any, launches: Any) -> list[Callable[[], object]]:
    """The tape's steps after the head, with this forward's attention launches in their
    places: what a replay runs after the plan."""
    ops = list(tape._tail)
    for at, launch in zip(tape._tail_attend_at, launches, strict=True):
        ops[at] = launch
    return ops


def _replans(runner: Any, bucket: int) -> list[Any]:
    planned = _planned(runner)
    replans = getattr(planned, "_replans", {}) if planned is not None else {}
    return [r for key, r in replans.items() if key[0] == bucket]


def checks_hooks(runner: Any, bucket: int) -> bool:
    """Whether a replan of ``bucket`` asks first if the schedule's hooks act on its plan (where
    ``ask_every_hook`` changes what :func:`host_steps` times)."""
    return any(getattr(r, "_hooks_act", None) is not None for r in _replans(runner, bucket))


def replan_ops(runner: Any, bucket: int, iters: int = 20) -> dict[str, float]:
    """The replans' own host work (``replan_rest_us``) op by op, each timed alone on the
    bucket's replans after their last plan, median us over ``iters`` (summed over the replans):
    ``indptr_copy_us`` the indptrs' pinned upload, ``mark_us`` the event recorded after a plan's
    copies, ``wait_us`` the next plan's wait on it (done: a query), ``info_check_us`` the plan
    info's comparison. What the rest has beyond these is Python (the host indptrs, the calls).

    Then the same ops right after another, as in the replay (the other not timed; the device
    synchronized before each pair): ``mark_after_module_us`` the mark after FlashInfer's module
    plan (which queues its schedule's copy), ``mark_after_copy_us`` after the indptr copy,
    ``mark_after_head_us`` / ``copy_after_head_us`` / ``module_after_head_us`` after the first
    segment's graph launch (the replay's step before the plan), ``mark_after_idle_us`` after
    200 us of sleep; ``stream_us`` the current-stream lookup the mark makes, ``raw_mark_us``
    the mark given its stream; ``python_after_sync_us`` / ``python_warm_us`` a fixed bit of
    pure Python right after the synchronize / after running it 50 times (whether the host
    thread starts each replay cold); ``python_after_busy_sync_us`` / ``python_after_busy_poll_us``
    the same right after the host waited out about 1 ms of device work (a replay's length) in
    the driver's synchronize / in a Python loop querying an event (:func:`waiter`): whether the
    driver's wait leaves the host cold; ``copy_after_launches_sync_us`` /
    ``copy_after_launches_poll_us`` the indptr copy right after the host waited, each way, for 56
    launches of the first segment's graph (a replay's count of launches): whether the first
    driver call after a replay pays for the work the driver retires then (against
    ``indptr_copy_us``)."""
    replans = [r for r in _replans(runner, bucket) if getattr(r, "_copied", None) is not None]
    if not replans or runner.device.type != "cuda":
        return {}
    head = list(getattr(_tape(runner, bucket), "_head", []))

    def nothing(r: Any) -> None:
        pass

    def launch_head(r: Any) -> None:
        for op in head:
            op()

    def module(r: Any) -> object:
        return r._call() if r._call is not None else None

    def copy(r: Any) -> object:
        return r.indptrs.copy_(r.host_indptrs, non_blocking=True)

    def mark(r: Any) -> object:
        return r._copied.record()

    def python(r: Any) -> int:  # a fixed bit of pure Python, a few microseconds
        total = 0
        for i in range(200):
            total += i & 7
        return total

    def warm(r: Any) -> None:
        for _ in range(50):
            python(r)

    def launches(wait: Callable[[], None]) -> Callable[[Any], None]:
        def setup(r: Any) -> None:
            for _ in range(56):
                launch_head(r)
            wait()

        return setup

    def busy(wait: Callable[[], None]) -> Callable[[Any], None]:
        def setup(r: Any) -> None:
            # about 1 ms of device time at the H100's and H200's 1,980 MHz (a sleep kernel
            # spins this many cycles; the length does not matter, only that the host waits)
            torch.cuda._sleep(2_000_000)
            wait()

        return setup

    stream = torch.cuda.current_stream(runner.device)
    ops: dict[str, tuple[Callable[[Any], object], Callable[[Any], object]]] = {
        "indptr_copy_us": (nothing, copy),
        "mark_us": (nothing, mark),
        "wait_us": (nothing, lambda r: r._copied.synchronize()),
        "info_check_us": (nothing, lambda r: bool(r.wrapper._plan_info == r._info)),
        "mark_after_module_us": (module, mark),
        "mark_after_copy_us": (copy, mark),
        "mark_after_head_us": (launch_head, mark),
        "copy_after_head_us": (launch_head, copy),
        "module_after_head_us": (launch_head, module),
        "mark_after_idle_us": (lambda r: time.sleep(2e-4), mark),
        "stream_us": (nothing, lambda r: torch.cuda.current_stream()),
        "raw_mark_us": (nothing, lambda r: r._copied.record(stream)),
        "python_after_sync_us": (nothing, python),
        "python_warm_us": (warm, python),
        "python_after_busy_sync_us": (busy(waiter(runner.device, "sync")), python),
        "python_after_busy_poll_us": (busy(waiter(runner.device, "poll")), python),
        "copy_after_launches_sync_us": (launches(waiter(runner.device, "sync")), copy),
        "copy_after_launches_poll_us": (launches(waiter(runner.device, "poll")), copy),
    }
    out: dict[str, float] = {}
    for key, (setup, op) in ops.items():
        per: list[int] = []
        for _ in range(iters + 2):
            torch.cuda.synchronize()
            took = 0
            for r in replans:
                setup(r)
                t = ns()
                op(r)
                took += ns() - t
            per.append(took)
        torch.cuda.synchronize()
        out[key] = round(statistics.median(per[2:]) / 1e3, 2)
    return out


def line_costs(
    runner: Any, batch: Any, bucket: int, iters: int = 20, top: int = 8
) -> list[tuple[str, float]]:
    """Where the plan step's host time goes, line by line: the replay's steps up to the first
    attention call, with a line tracer on the planned path's ``prepare`` and the replan's call
    while this forward's launches are resolved; each line's mean microseconds per replay
    (inclusive of what it calls), the ``top`` most, as ``(function:line source, us)``. The
    tracer adds about a microsecond per traced line and a little per call, so a line far above
    its neighbours is where the time is, not its exact cost. Empty where there is no planned
    path."""
    import linecache
    import sys

    from service.ranks.attention.flashinfer_replan import RaggedReplan

    tape = _tape(runner, bucket)
    planned = _planned(runner)
    if tape is None or planned is None or not hasattr(tape, "_tail"):
        return []
    targets = {type(planned).prepare.__code__, RaggedReplan.__call__.__code__}
    totals: dict[tuple[str, int, str], int] = {}

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code not in targets:
            return None
        code = frame.f_code
        state = [frame.f_lineno, ns()]

        def local(frame: Any, event: str, arg: Any) -> Any:
            now = ns()
            key = (code.co_name, state[0], code.co_filename)
            totals[key] = totals.get(key, 0) + now - state[1]
            state[0] = frame.f_lineno
            state[1] = ns()  # the tracer's own time left out
            return local

        return local

    sync = waiter(runner.device, "sync")
    for i in range(iters + 2):
        sync()
        if i == 2:
            totals.clear()  # the first two warm up
        view = runner.attention.load(runner.buffers, batch, bucket)
        for op in tape._head:
            op()
        sys.settrace(tracer)
        try:
            launches = runner.attention.launches(view, bucket, tape.calls)
        finally:
            sys.settrace(None)
        for op in _tail(tape, launches):
            op()
        for g in tape.graphs:
            g.replays += 1
    sync()
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return [
        (f"{name}:{line} {linecache.getline(path, line).strip()[:60]}", round(t / iters / 1e3, 2))
        for (name, line, path), t in ranked
    ]


def plan_only_runner(replan: Any, lengths: Any, slots: int, bucket: int = 256) -> Any:
    """A stand-in runner whose replay of ``bucket`` is its plan alone: the planned path's
    ``prepare`` calls ``replan(lengths)``; no graph, no attention launch, no device. What
    :func:`line_costs` traces, on CPU (host_costs.py tracer and its test)."""
    from types import SimpleNamespace as NS

    class Planned:
        def prepare(self, view: object, bucket: int, variant: str, slots: int) -> None:
            replan(lengths)

    planned = Planned()
    attention = NS(
        planned=planned, load=lambda *a: None,
        launches=lambda view, b, calls: (planned.prepare(view, b, "ragged", slots), [])[1],
    )  # fmt: skip
    tape = NS(_head=[], _tail=[], _tail_attend_at=[], graphs=[], calls=None)
    return NS(_captured={bucket: tape}, attention=attention, device=torch.device("cpu"),
              buffers=None)  # fmt: skip


def host_steps(
    runner: Any,
    batch: Any,
    bucket: int,
    iters: int = 20,
    ask_every_hook: bool = False,
    wait: str = "sync",
) -> dict[str, float] | None:
    """Median host microseconds of each step of ``runner``'s replay of ``bucket`` over
    ``batch``; ``None`` for a runner without a replay tape (``full``, eager). ``ask_every_hook``:
    the replans ask each of the schedule's hooks even where none acts on the plan (their path
    before the ``_hooks_act`` check: side by side with it, what that check saves). ``wait``: how
    the host waits for each replay to finish before the next (:func:`waiter`)."""
    tape = _tape(runner, bucket)
    if tape is None or not hasattr(tape, "_tail") or not hasattr(runner, "attention"):
        return None
    sync = waiter(runner.device, wait)
    launchers = [g.launcher() for g in tape.graphs]  # bound methods: equal per graph
    at = set(tape._tail_attend_at)
    kinds = [  # the tail's steps, in order
        "attention" if i in at else ("graph" if op in launchers else "copy")
        for i, op in enumerate(tape._tail)
    ]
    # the replans' parts: FlashInfer's module plan, the schedule's hooks around it; what is left
    # of the replans (``replan_rest_us``) is their own host work: the wait on the last plan's
    # copies, the host indptrs, the indptr copy's launch, the plan info's check
    parts = {k: _replan_timer(runner, bucket, k) for k in (
        "_call", "_hooks_act", "_graph_plan", "_device_plan", "_after")}  # fmt: skip
    module_ns = parts["_call"][0]
    planned = _planned(runner)
    # the plan step's parts: the replans (prepare) and, inside them, the device planner's
    # Triton launch (SM90Rebalance._queue_plan); the rest is the launchers' lookup
    prepare_ns, restore_prepare = _timer(planned, "prepare")
    launch_ns, restore_launch = _timer(getattr(planned, "balance", None), "_queue_plan")

    skipped = [r for r in _replans(runner, bucket) if ask_every_hook and r._hooks_act is not None]
    checks = [r._hooks_act for r in skipped]
    for r in skipped:
        r._hooks_act = None

    def restore() -> None:
        for _, undo in parts.values():
            undo()
        restore_prepare()
        restore_launch()
        for r, check in zip(skipped, checks, strict=True):
            r._hooks_act = check

    rows: dict[str, list[float]] = {k: [] for k in (
        "load_us", "head_us", "plan_us", "plan_module_us", "prepare_us", "planner_launch_us",
        "hooks_act_us", "graph_plan_us", "device_plan_us", "after_us", "hooks_us",
        "replan_rest_us",
        "attention_launch_us", "graph_launch_us", "copy_us", "first_attention_us",
        "total_us")}  # fmt: skip
    try:
        for _ in range(iters + 2):
            sync()
            for kept in (*(got for got, _ in parts.values()), prepare_ns, launch_ns):
                kept.clear()
            per: dict[str, list[int]] = {"attention": [], "graph": [], "copy": []}
            t0 = ns()
            view = runner.attention.load(runner.buffers, batch, bucket)
            t1 = ns()
            for op in tape._head:
                op()
            t2 = ns()
            launches = runner.attention.launches(view, bucket, tape.calls)
            t3 = ns()
            ops = _tail(tape, launches)
            first = None
            for op, kind in zip(ops, kinds, strict=True):
                s = ns()
                op()
                e = ns()
                per[kind].append(e - s)
                if first is None and kind == "attention":
                    first = e - t0
            t4 = ns()
            for g in tape.graphs:
                g.replays += 1
            sync()
            if _ < 2:  # warm-up
                continue
            rows["load_us"].append((t1 - t0) / 1e3)
            rows["head_us"].append((t2 - t1) / 1e3)
            rows["plan_us"].append((t3 - t2) / 1e3)
            rows["plan_module_us"].append(sum(module_ns) / 1e3 if module_ns else float("nan"))
            rows["prepare_us"].append(sum(prepare_ns) / 1e3 if prepare_ns else float("nan"))
            rows["planner_launch_us"].append(sum(launch_ns) / 1e3 if launch_ns else float("nan"))
            hooks = 0
            for key, name in (
                ("hooks_act_us", "_hooks_act"), ("graph_plan_us", "_graph_plan"),
                ("device_plan_us", "_device_plan"), ("after_us", "_after"),
            ):  # fmt: skip
                got = parts[name][0]
                hooks += sum(got)
                rows[key].append(sum(got) / 1e3 if got else float("nan"))
            rows["hooks_us"].append(hooks / 1e3 if prepare_ns else float("nan"))
            rows["replan_rest_us"].append(
                (sum(prepare_ns) - sum(module_ns) - hooks) / 1e3 if prepare_ns else float("nan")
            )
            rows["first_attention_us"].append((first or 0) / 1e3)
            rows["total_us"].append((t4 - t0) / 1e3)
            for kind in ("attention", "graph", "copy"):
                if per[kind]:
                    rows[f"{kind}_launch_us" if kind != "copy" else "copy_us"].append(
                        statistics.median(per[kind]) / 1e3
                    )
    finally:
        restore()
    out = {k: round(statistics.median(v), 2) for k, v in rows.items() if v}
    out["steps"] = len(ops)
    return out


HEADER = (f"{'backend':>13} {'bucket':>6} {'load':>6} {'head':>6} {'plan':>6} {'module':>7} "
          f"{'prepare':>7} {'planner':>7} {'hooks':>6} {'rest':>6} "
          f"{'1st attn':>8} {'attn':>6} {'graph':>6} {'total':>7}")  # fmt: skip


def ops_row(s: dict[str, float]) -> str:
    """The replans' own ops (:func:`replan_ops`) of one row, or "" where not timed."""
    names = {"indptr_copy_us": "indptr copy", "mark_us": "mark", "wait_us": "wait",
             "info_check_us": "info check"}  # fmt: skip
    got = [f"{n} {s[k]:.1f}" for k, n in names.items() if k in s]
    later = ("mark_after_module_us", "mark_after_copy_us", "mark_after_head_us",
             "copy_after_head_us", "module_after_head_us", "mark_after_idle_us", "stream_us",
             "raw_mark_us", "python_after_sync_us", "python_warm_us",
             "python_after_busy_sync_us", "python_after_busy_poll_us",
             "copy_after_launches_sync_us", "copy_after_launches_poll_us")  # fmt: skip
    after = [f"{k.removesuffix('_us')} {s[k]:.1f}" for k in later if k in s]
    if not got:
        return ""
    return (
        f"{'':>20} the rest's ops alone: "
        + ", ".join(got)
        + (f"\n{'':>20} after another: " + ", ".join(after) if after else "")
    )


def row(backend: str, bucket: int, s: dict[str, float]) -> str:
    def f(k: str, w: int = 6) -> str:
        v = s.get(k)
        return f"{v:>{w}.1f}" if v is not None else f"{'-':>{w}}"

    return (f"{backend:>13} {bucket:>6} {f('load_us')} {f('head_us')} {f('plan_us')} "
            f"{f('plan_module_us', 7)} {f('prepare_us', 7)} {f('planner_launch_us', 7)} "
            f"{f('hooks_us')} {f('replan_rest_us')} "
            f"{f('first_attention_us', 8)} {f('attention_launch_us')} "
            f"{f('graph_launch_us')} {f('total_us', 7)}")  # fmt: skip
