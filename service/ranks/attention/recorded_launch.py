"""The one kernel call a FlashInfer ``run`` makes, recorded so that it can be made again directly.

Why: FlashInfer's Python ``run`` re-derives the same arguments on every call (backend dispatch,
shape and dtype checks, API logging), and the module function it ends in is itself a Python
function around the compiled (tvm-ffi) kernel call: together about 15-20 us of host time per
layer on the H200's host, against a device layer of about 60 us at small buckets. The arguments
of that compiled call (the plan's info and buffers, the q/k/v/out views) do not change until the
next plan, so a segment runner, whose layers call attention over the same views, makes it once
through ``run`` with the compiled call recorded, then directly for every layer of the forward.

Two levels are recorded, both checked, not assumed:

1. ``run`` with the wrapper's compiled module swapped for a recorder: exactly one module call
   must be made (else ``None``: keep calling ``run``).
2. That module function (a Python function registered as FlashInfer's op) with the compiled
   callables it closes over swapped for recorders: when it makes exactly one such call, that call
   is what is made again; otherwise the module function itself.

With ``execute=False`` the recorded calls are not forwarded: nothing runs on the device while
recording, so a runner can resolve every layer's launch before the first one. Recording swaps
attributes and closure cells of shared FlashInfer objects for the duration of one call, so it
must not overlap another thread's call of the same kernel (a rank runs its forwards on one
thread).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

Call = tuple[str, tuple, dict[str, Any]]


class _Recorder:
    """Stands in for a wrapper's compiled module during one ``run``: records the (method,
    arguments) of every call and forwards it when ``execute``."""

    def __init__(self, module: Any, execute: bool) -> None:
        self.module = module
        self.execute = execute
        self.calls: list[Call] = []

    def __getattr__(self, name: str) -> Any:
        got = getattr(self.module, name)
        if not callable(got):
            return got

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            return got(*args, **kwargs) if self.execute else None

        return call


def recorded_launch(
    wrapper: Any, run: Callable[[], Any], execute: bool = True
) -> Callable[[], Any] | None:
    """Run ``run`` (a wrapper's ``run`` over fixed views) with its module call recorded, and
    return that call, to be made again directly; ``None`` (keep calling ``run``) unless it made
    exactly one. ``execute=False``: nothing is launched while recording (the call is only
    recorded). Valid until the wrapper's next plan."""
    module = getattr(wrapper, "_cached_module", None)
    if module is None:
        if execute:
            run()
        return None
    recorder = _Recorder(module, execute)
    wrapper._cached_module = recorder
    try:
        run()
    finally:
        wrapper._cached_module = module
    if len(recorder.calls) != 1:
        return None
    name, args, kwargs = recorder.calls[0]
    return innermost(getattr(module, name), args, kwargs)


def _compiled(obj: Any) -> bool:
    """A callable that is not Python code of FlashInfer's own (a function, method, class or
    partial): the compiled kernel entry points a module function closes over."""
    plain = (types.FunctionType, types.MethodType, type, functools.partial)
    return callable(obj) and not isinstance(obj, plain)


def innermost(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Callable[[], Any]:
    """``fn(*args, **kwargs)`` as a zero-argument call, one level down where that is exact: when
    ``fn`` is a Python function whose body makes exactly one call of a compiled callable it
    closes over, that call with the arguments it was given (recorded, not executed)."""
    outer = functools.partial(fn, *args, **kwargs)
    cells = [
        c for c in getattr(fn, "__closure__", None) or ()
        if _cell_holds(c) and _compiled(c.cell_contents)
    ]  # fmt: skip
    if not cells:
        return outer
    calls: list[tuple[Any, tuple, dict[str, Any]]] = []
    originals = [c.cell_contents for c in cells]

    def recorder(target: Any) -> Callable[..., None]:
        def call(*a: Any, **k: Any) -> None:
            calls.append((target, a, k))

        return call

    recognised = True
    try:
        for cell, target in zip(cells, originals, strict=True):
            cell.cell_contents = recorder(target)
        fn(*args, **kwargs)
    except Exception:  # a body that needs the real call's result: keep the outer call
        recognised = False
    finally:
        for cell, target in zip(cells, originals, strict=True):
            cell.cell_contents = target
    if not recognised or len(calls) != 1:
        return outer
    target, a, k = calls[0]
    return functools.partial(target, *a, **k)


def _cell_holds(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True
