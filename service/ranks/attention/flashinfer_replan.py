"""FlashInfer's ragged-prefill plan for a CUDA-graph wrapper, made again without its Python.

Why: ``full`` plans before every replay, and the device waits for that plan (and then the
launch) before its first kernel. FlashInfer's ``plan`` re-derives on every call what cannot
change for one wrapper in CUDA-graph mode (backend choice, module lookup, dtype
canonicalisation, API logging, a dozen small torch CPU ops on the indptrs), then copies the
indptrs into the buffers the graph reads and makes one call into the compiled module, which
schedules the batch on the host and queues the copy of that schedule to the device. After a
wrapper's first plan, :class:`RaggedReplan` does only the last two: one copy of both indptrs and
that module call, with this batch's host arrays.

Checked, not assumed: the first plan goes through FlashInfer twice, the second time with the
module's ``plan`` function wrapped to record its call (the first plan picks and installs the
module, so it cannot be recorded by swapping the module as :func:`recorded_launch` does for
``run``). The fast path is taken only when that plan made exactly one such call whose arguments
are recognised (the host indptr by identity, the KV lengths by value), and every fast replan
must return the plan info of the first: the CUDA-graph contract that keeps the captured kernels'
arguments valid.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from service.ranks.host_staging import host_buffer


class RaggedReplan:
    """Plans of one CUDA-graph ragged wrapper whose query and KV ranges are the same (prefill
    without a cached prefix): the first through FlashInfer, later ones through its module call.

    ``indptrs`` is the (2, S+1) int32 device tensor whose rows are the wrapper's query and KV
    indptr buffers; ``plan`` is FlashInfer's plan of the wrapper for a host indptr."""

    def __init__(
        self,
        wrapper: Any,
        indptrs: torch.Tensor,
        plan: Callable[[torch.Tensor], None],
        after: Callable[[bool], object] | None = None,
        device_plan: Callable[[np.ndarray], bool] | None = None,
        graph_plan: Callable[[np.ndarray], bool] | None = None,
        hooks_act: Callable[[np.ndarray], bool] | None = None,
    ) -> None:
        self.wrapper = wrapper
        self.indptrs = indptrs
        self._plan = plan
        # after every plan, once FlashInfer's schedule is written and its copy queued (the FA3
        # schedule dealt again: flashinfer_backend's _balanced), told whether the plan info was
        # checked equal to the first plan's
        self._after = after
        # a later plan made on the device instead of the module call (sm90_schedule's planner,
        # FA3's schedule dealt from the lengths), told this plan's slot lengths after the indptr
        # copy is queued: False where it did not plan, and the module call plans as before
        self._device_plan = device_plan
        # a later plan made by one graph launch that copies this replan's host indptrs
        # (host_indptrs) to the device and plans there (sm90_schedule's replay_plan), told this
        # plan's slot lengths before anything is copied: False where it did not
        self._graph_plan = graph_plan
        # told a later plan's slot lengths first: False where graph_plan, device_plan and after
        # would all decline it (FlashInfer's schedule kept as made), and none is asked
        self._hooks_act = hooks_act
        self._call: Callable[[], Any] | None = None  # the module's plan, arguments bound
        self._info: Any = None  # the first plan's info, as the module returned it
        self._recorded = False  # the first plan was made, its module call recorded if it could
        self.fast = False  # whether the last plan took the fast path
        cuda = indptrs.device.type == "cuda"
        # one host buffer for every plan (a pinned allocation per plan cost the H200's host
        # about 50 us before each replay): both indptr rows, then the KV lengths
        n = indptrs.shape[1]
        self._host, self._a = host_buffer(2 * n + (n - 1), torch.int32, cuda)
        self._both, self._kv_lens = self._host[: 2 * n].view(2, n), self._host[2 * n :]
        self._rows = self._a[: 2 * n].reshape(2, n)
        self._rows[:, 0] = 0  # both indptrs start at 0; no plan writes that column
        # the last copies out of that buffer and out of the wrapper's pinned schedule buffer
        # (the module's plan writes it, then queues its upload): both must be done before they
        # are rewritten (a replan may come while the previous one's copies are still queued
        # behind a forward)
        self._copied = torch.cuda.Event() if cuda else None
        self._pending = False

    def __call__(self, lengths: np.ndarray) -> None:
        """Plan for requests of these query lengths (sentinels: 0), S of them."""
        if lengths.shape[0] != self._kv_lens.shape[0]:
            raise ValueError(
                f"a plan of {lengths.shape[0]} request slots for a wrapper of "
                f"{self._kv_lens.shape[0]}"
            )
        if self._pending and self._copied is not None:
            self._copied.synchronize()  # done long ago in steady state: a query, no wait
        rows, both, kv_lens = self._rows, self._both, self._kv_lens
        # the ufunc itself: np.cumsum's Python wrapper cost more than the sum over a few slots
        # (benchmarks/host_costs.py replan)
        np.add.accumulate(lengths, out=rows[0, 1:], dtype=np.int32)
        rows[1] = rows[0]
        self._a[rows.size :] = lengths
        if self._call is None:
            self.fast = False
            if self._recorded:  # not recognised: every plan goes through FlashInfer
                self._plan(both[0])
            else:
                self._recorded = True
                self._first(both[0], kv_lens)
            self._mark_copied()  # FlashInfer copied the indptr from our buffer too
            if self._after is not None:
                self._after(False)
            return
        hooks = self._hooks_act is None or self._hooks_act(lengths)
        if hooks and self._graph_plan is not None and self._graph_plan(lengths):
            self._mark_copied()  # the graph's copy reads our buffer
            self.fast = True
            return
        self.indptrs.copy_(both, non_blocking=True)  # the buffers the captured kernels read
        if hooks and self._device_plan is not None and self._device_plan(lengths):
            # the schedule is written on the device from those buffers; the plan info and every
            # buffer the kernels read stay the first plan's
            self._mark_copied()
            self.fast = True
            return
        info = self._call()  # its host arrays are views of our buffer: this batch's layout
        # marked after the module call, which queued its own copy of the schedule out of the
        # wrapper's pinned buffer: the next plan rewrites that buffer too, so its wait must cover
        # both copies, not only ours (marked before it, the wait could return while the
        # schedule's copy was still queued, and the next schedule overwrite it)
        self._mark_copied()
        # one structural comparison in the compiled library (FlashInfer returns an FFI array;
        # converting it to a list cost tens of microseconds per plan)
        if not bool(info == self._info):
            raise RuntimeError(
                "FlashInfer's plan info changed between plans of one CUDA-graph wrapper; "
                "its captured graph is no longer valid (run with --prefill-backend breakable)"
            )
        self.wrapper._plan_info = info
        self.fast = True
        if hooks and self._after is not None:
            self._after(True)

    @property
    def plans_on_device(self) -> bool:
        """Whether a later plan may be made on the device (a planner or its graph) instead of
        the module call."""
        return self._device_plan is not None or self._graph_plan is not None

    @property
    def host_indptrs(self) -> torch.Tensor:
        """The (2, S+1) int32 host rows each plan writes (pinned on CUDA) and copies into
        ``indptrs``: a graph that copies them reads them at its replay."""
        return self._both

    def _mark_copied(self) -> None:
        if self._copied is not None:
            self._copied.record()
            self._pending = True

    def _first(self, qo: torch.Tensor, kv_lens: torch.Tensor) -> None:
        self._plan(qo)  # picks the backend and installs the module
        module = getattr(self.wrapper, "_cached_module", None)
        plan_fn = getattr(module, "plan", None)
        if plan_fn is None:
            return  # a backend without a module plan: every plan goes through FlashInfer
        calls: list[tuple[tuple, dict]] = []

        def record(*args: Any, **kwargs: Any) -> Any:
            calls.append((args, kwargs))
            return plan_fn(*args, **kwargs)

        try:
            module.plan = record
        except AttributeError:
            return
        try:
            self._plan(qo)
        finally:
            module.plan = plan_fn
        if len(calls) != 1 or self.wrapper._cached_module is not module:
            return
        args, kwargs = calls[0]
        at_indptr = [i for i, x in enumerate(args) if x is qo]
        at_lens = [
            i
            for i, x in enumerate(args)
            if isinstance(x, torch.Tensor) and x is not qo and x.device.type == "cpu"
            and x.dtype == torch.int32 and x.shape == kv_lens.shape and torch.equal(x, kv_lens)
        ]  # fmt: skip
        if not at_indptr or len(at_lens) != 1:
            return
        args = list(args)
        args[at_lens[0]] = kv_lens  # FlashInfer's own copy of the lengths: ours from now on
        # every argument is now fixed: the indptr and lengths are views of this replan's host
        # buffer, rewritten before each call
        self._info = self.wrapper._plan_info
        self._call = functools.partial(plan_fn, *args, **kwargs)
