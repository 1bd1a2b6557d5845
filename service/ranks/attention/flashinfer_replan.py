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
        self, wrapper: Any, indptrs: torch.Tensor, plan: Callable[[torch.Tensor], None]
    ) -> None:
        self.wrapper = wrapper
        self.indptrs = indptrs
        self._plan = plan
        self._call: tuple[Callable[..., Any], list, dict, list[int], int] | None = None
        self._info: list[int] | None = None
        self._recorded = False  # the first plan was made, its module call recorded if it could
        self.fast = False  # whether the last plan took the fast path
        self.pin = indptrs.device.type == "cuda"

    def __call__(self, lengths: np.ndarray) -> None:
        """Plan for requests of these query lengths (sentinels: 0), S of them."""
        host, a = host_buffer(self.indptrs.numel() + lengths.shape[0], torch.int32, self.pin)
        n = self.indptrs.shape[1]
        rows = a[: 2 * n].reshape(2, n)
        rows[:, 0] = 0
        np.cumsum(lengths, out=rows[0, 1:])
        rows[1] = rows[0]
        a[2 * n :] = lengths
        both, kv_lens = host[: 2 * n].view(2, n), host[2 * n :]
        if self._call is None:
            self.fast = False
            if self._recorded:  # not recognised: every plan goes through FlashInfer
                self._plan(both[0])
            else:
                self._recorded = True
                self._first(both[0], kv_lens)
            return
        method, args, kwargs, at_indptr, at_lens = self._call
        for i in at_indptr:
            args[i] = both[0]
        args[at_lens] = kv_lens
        self.indptrs.copy_(both, non_blocking=True)  # the buffers the captured kernels read
        info = method(*args, **kwargs)
        if list(info) != self._info:
            raise RuntimeError(
                "FlashInfer's plan info changed between plans of one CUDA-graph wrapper; "
                "its captured graph is no longer valid (run with --prefill-backend breakable)"
            )
        self.wrapper._plan_info = info
        self.fast = True

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
        self._info = list(self.wrapper._plan_info)
        self._call = (plan_fn, list(args), dict(kwargs), at_indptr, at_lens[0])
