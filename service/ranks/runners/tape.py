"""A segment runner's replay of one bucket as a flat list: graph replays and attention calls.

Why: between two segment replays the host should make the attention launch and the next graph
launch, nothing else (the issue's bar for ``breakable`` and ``tc_piecewise``). Going through the
model (``attend``), the bound attention's per-call bookkeeping, FlashInfer's Python ``run`` and
torch's graph wrapper cost about as much host time per layer as the two launches themselves; on
the H200's host the segment backends were host-bound at small buckets (the device waited for
every launch). A tape is recorded once per bucket, at capture, over the tensors the segments read
and write (the same objects at every replay); at replay the bound attention resolves its calls
once for the forward (``segment_attention.py``) and the tape runs the zero-argument calls in
order.

The captured calls' ``replays`` counters are advanced after the tape ran, so tests and the
hit/miss proof still see every graph that replayed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from service.errors import CaptureFailed
from service.model.attention import AttendCall, AttentionKey, BoundAttention, KVTarget
from service.ranks.attention.base import AttendCalls, Bound, Launcher
from service.ranks.runners.graph_capture import CapturedCall


class Tape:
    """Steps in replay order: a :class:`CapturedCall` (its graph replays), an
    :class:`AttendCall` (attention into its ``out``), or a zero-argument callable (a copy the
    replay needs, e.g. a piece's staged input)."""

    def __init__(
        self, steps: Sequence[CapturedCall | AttendCall | Callable[[], Any]], result: torch.Tensor
    ) -> None:
        self.result = result
        self.graphs = [s for s in steps if isinstance(s, CapturedCall)]
        attend = [s for s in steps if isinstance(s, AttendCall)]
        self.calls = AttendCalls(tuple(attend))
        # the attention positions are filled per forward; the rest is fixed
        template: list[Callable[[], Any] | None] = []
        attend_at: list[int] = []
        for s in steps:
            if isinstance(s, AttendCall):
                attend_at.append(len(template))
                template.append(None)
            elif isinstance(s, CapturedCall):
                template.append(s.launcher())
            else:
                template.append(s)
        self.num_copies = len(template) - len(self.graphs) - len(attend_at)
        # what runs before the first attention call, then the rest with its attention slots
        first = attend_at[0] if attend_at else len(template)
        self._head = template[:first]
        self._tail = template[first:]
        self._tail_attend_at = [at - first for at in attend_at]

    @property
    def num_attention_calls(self) -> int:
        return len(self.calls.calls)

    def run(self, resolve: Callable[[], Sequence[Launcher]]) -> torch.Tensor:
        """Replay the bucket; the final hidden states. The steps before the first attention
        call (the first graph: embedding up to layer 0's attention inputs) run first, then
        ``resolve`` gives this forward's attention launches (one per call of ``calls``): the
        device runs that graph while the host plans attention."""
        for op in self._head:
            op()  # type: ignore[misc]
        ops = list(self._tail)
        for at, launch in zip(self._tail_attend_at, resolve(), strict=True):
            ops[at] = launch
        for op in ops:
            op()  # type: ignore[misc]
        for graph in self.graphs:
            graph.replays += 1
        return self.result


def bound(attention: BoundAttention) -> Bound:
    """The eager attention of a forward as a tape needs it (every backend's ``bind`` makes one)."""
    if not isinstance(attention, Bound):
        raise TypeError(
            f"a segment runner's attention must bind to a Bound (with launchers), "
            f"not {type(attention).__name__}"
        )
    return attention


class RecordingAttention:
    """The bound attention of a capture that records each call as a tape step, in order.

    A tape replays an attention call by its ``out``, so every call must write its result
    there: a call without one, or whose result is elsewhere, makes :meth:`check` fail the
    capture."""

    def __init__(self, inner: BoundAttention, steps: list[Any]) -> None:
        self.inner = inner
        self.steps = steps
        self.decode = inner.decode
        self.problem: str | None = None

    def store(self, k: torch.Tensor, v: torch.Tensor, key: AttentionKey) -> None:
        self.inner.store(k, v, key)

    def kv_target(self, key: AttentionKey) -> KVTarget | None:
        return self.inner.kv_target(key)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        res = self.inner(q, k, v, key, out)
        if out is None:
            self.problem = f"attention of {key} was called without an output buffer"
        elif res.data_ptr() != out.data_ptr() or res.stride() != out.stride():
            self.problem = f"attention of {key} returned its result outside its output buffer"
        else:
            self.steps.append(AttendCall(q, k, v, key, out))
        return res

    def check(self) -> None:
        if self.problem is not None:
            raise CaptureFailed(f"no replay tape: {self.problem}")
