"""A CPU stand-in for a CUDA graph: the aten ops of one call, recorded once and replayed.

While ``fn`` runs once under a dispatch mode, every aten op it reaches is recorded with its
arguments: tensors that existed before the call (static buffers, parameters, the KV pool) by
reference, tensors an earlier op produced by position. A replay re-runs exactly those ops in
that order and nothing else: Python control flow, host-side values and attribute lookups of
``fn`` ran once, at recording, and are frozen, as a CUDA graph freezes them; writes into the
referenced tensors happen again, reads see their current contents.

Why not ``make_fx``: it builds fake-tensor metadata for every node, which made capture 30x
slower than the forward itself on CPU (0.5 s per bucket for the built-in model); this records
what a replay needs and no more. Intermediates are released after their last use at replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary


@dataclass(frozen=True)
class _Slot:
    """An argument produced by an earlier op: the position of its value at replay."""

    index: int


@dataclass(frozen=True)
class _Op:
    func: Any  # an aten OpOverload
    args: tuple  # with _Slot for produced tensors, the tensors themselves for external ones
    kwargs: dict
    outputs: tuple[int | None, ...]  # slot of each leaf of the result (None: not a tensor)
    release: tuple[int, ...]  # slots whose last use is this op


class OpTrace:
    """The recorded ops of one call; calling it replays them and returns the call's outputs."""

    def __init__(self, ops: list[_Op], out_leaves: list[Any], out_spec: Any, num_slots: int):
        self.ops = ops
        self._out_leaves = out_leaves
        self._out_spec = out_spec
        self._num_slots = num_slots

    def __len__(self) -> int:
        return len(self.ops)

    def __call__(self) -> Any:
        values: list[Any] = [None] * self._num_slots

        def resolve(a: Any) -> Any:
            return values[a.index] if isinstance(a, _Slot) else a

        for op in self.ops:
            args = pytree.tree_map(resolve, op.args)
            kwargs = pytree.tree_map(resolve, op.kwargs)
            out = op.func(*args, **kwargs)
            for slot, leaf in zip(op.outputs, pytree.tree_leaves(out), strict=False):
                if slot is not None:
                    values[slot] = leaf
            for slot in op.release:
                values[slot] = None
        return pytree.tree_unflatten([resolve(a) for a in self._out_leaves], self._out_spec)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, tuple[int | None, ...]]] = []
        self.slots: WeakIdKeyDictionary = WeakIdKeyDictionary()  # produced tensor -> slot
        self.num_slots = 0

    def ref(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a in self.slots:
            return _Slot(self.slots[a])
        return a

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec_args = pytree.tree_map(self.ref, args)
        rec_kwargs = pytree.tree_map(self.ref, kwargs)
        out = func(*args, **kwargs)
        outputs: list[int | None] = []
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                # an in-place op or an out= write returns its argument: same slot, same object
                if leaf not in self.slots:
                    self.slots[leaf] = self.num_slots
                    self.num_slots += 1
                outputs.append(self.slots[leaf])
            else:
                outputs.append(None)
        self.ops.append((func, rec_args, rec_kwargs, tuple(outputs)))
        return out


def record(fn: Callable[[], Any]) -> tuple[OpTrace, Any]:
    """Run ``fn`` once, recording its aten ops. Returns the trace and this run's outputs."""
    recorder = _Recorder()
    with recorder:
        out = fn()
    leaves, spec = pytree.tree_flatten(out)
    out_leaves = [recorder.ref(x) for x in leaves]
    last_use: dict[int, int] = {}
    for i, (_, args, kwargs, _) in enumerate(recorder.ops):
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, _Slot):
                last_use[a.index] = i
    keep = {a.index for a in out_leaves if isinstance(a, _Slot)}
    release: dict[int, list[int]] = {}
    for i, (_, _, _, outputs) in enumerate(recorder.ops):
        for slot in outputs:
            if slot is not None and slot not in keep:
                # after its last use; an unused result right away
                release.setdefault(last_use.get(slot, i), []).append(slot)
    ops = [
        _Op(func, args, kwargs, outputs, tuple(sorted(set(release.get(i, ())))))
        for i, (func, args, kwargs, outputs) in enumerate(recorder.ops)
    ]
    return OpTrace(ops, out_leaves, spec, recorder.num_slots), out
