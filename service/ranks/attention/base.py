"""The attention-backend interface: store K/V into the pool and attend, per (layer, variant).

The model's side of the contract (:class:`AttentionKey`, :class:`AttentionSpec`, the registry,
the attend function type) lives in :mod:`service.model.attention`; backends implement it here.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from service.model.attention import (
    MLA_NEW,
    AttendCall,
    AttentionKey,
    AttentionRegistry,
    AttentionSpec,
    BoundAttention,
    KVTarget,
)
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.ranks.kv_pool import ReqToTokenPool, TokenKVPool


class AttentionBackend(ABC):
    """Stores K/V into the pool and attends over each request's cached prefix and new tokens."""

    name: str = "base"
    graph_safe: bool = False  # may run inside a captured graph (the `full` backend needs it)

    def __init__(
        self, registry: AttentionRegistry, kv: TokenKVPool, req_to_token: ReqToTokenPool
    ) -> None:
        self.registry = registry
        self.kv = kv
        self.req_to_token = req_to_token

    def store(
        self, k: torch.Tensor, v: torch.Tensor, key: AttentionKey, batch: ForwardBatch
    ) -> None:
        """Each token's K/V (T, Hkv*D) to its KV slot; padded tokens write the padding slot.
        MLA's MHA path stores nothing: its layer stores the latent through the MQA path."""
        spec = self.registry.spec(key)
        if spec.kind == MLA_NEW:
            return
        t = k.shape[0]
        k3 = k.view(t, spec.num_kv_heads, spec.head_dim)
        v3 = v.view(t, spec.num_kv_heads, spec.head_dim)
        self.kv.store(spec.kv_layer, batch.out_cache_loc, k3, v3)

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        batch: ForwardBatch,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of this pass's queries; the cache already holds this pass's K/V."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Store and attend, for one call outside a model forward (tests, references)."""
        bound = self.bind(batch)
        bound.store(k, v, key)
        return bound(q, k, v, key)

    # A graph-safe backend may need one graph per bucket and *variant* (kernels chosen by the
    # request layout, e.g. FlashInfer's ragged kernel for batches without a cached prefix): the
    # `full` runner captures every variant and replays the one the batch's layout selects.
    graph_variants: tuple[str, ...] = ("any",)

    def graph_variant(self, layout: BatchLayout) -> str:
        """The variant whose graph serves a batch of this layout."""
        return self.graph_variants[0]

    # Whether a captured graph of this backend reads the batch's request tensors (request pool
    # rows, prefix and extend lengths, starts). A backend that plans on the host from the
    # layout into buffers of its own does not, and a replay then copies the token rows alone.
    graph_reads_requests: bool = True

    def prepare(
        self, batch: ForwardBatch, bucket: int, variant: str = "any", num_slots: int | None = None
    ) -> None:
        """Host-side planning before the graph of ``bucket`` (and ``variant``) is captured or
        replayed over ``batch`` (outside the graph), over ``num_slots`` request slots (default:
        the batch's request tensors' length). Backends whose metadata is computed in-graph need
        none."""
        return None

    def graph_prologue(self, bucket: int, variant: str) -> None:
        """Device work on the plan that ``prepare`` made, captured at the start of the graph
        that first reads it (before layer 0's attention), so every replay does it with no host
        work (FlashInfer: the SM90 schedule dealt again). Most backends need none."""
        return None

    def bind_variant(self, batch: ForwardBatch, variant: str) -> BoundAttention:
        """:meth:`bind` for the graph of one variant (called inside the captured function)."""
        return self.bind(batch)

    def forget(self, bucket: int) -> None:
        """Drop what ``prepare`` keeps for ``bucket`` (its capture failed on another rank)."""
        return None

    def bind(self, batch: ForwardBatch) -> BoundAttention:
        """The attention a model forward of ``batch`` calls (once per forward, so per-batch
        planning happens once, not once per layer)."""

        def attend(q, k, v, key, out):
            return self.attend(q, k, v, key, batch, out)

        return Bound(self, batch, attend)

    def heads(self, q: torch.Tensor, key: AttentionKey) -> tuple[AttentionSpec, torch.Tensor]:
        """The path's metadata and q split into heads (T, Hq, D)."""
        spec = self.registry.spec(key)
        if q.shape[-1] != spec.num_heads * spec.head_dim:
            raise ValueError(
                f"query of width {q.shape[-1]} does not match its path's metadata "
                f"({spec.num_heads} heads x {spec.head_dim})"
            )
        return spec, q.view(q.shape[0], spec.num_heads, spec.head_dim)


class PlannedAttention(AttentionBackend):
    """A backend that plans once per forward, in :meth:`bind`; a single call binds too."""

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        batch: ForwardBatch,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        return self.bind(batch)(q, k, v, key, out)


@dataclass(frozen=True, eq=False)
class AttendCalls:
    """A bucket's attention calls in order. ``memo`` is for a backend to keep what it derives
    from the calls once (which calls share a launch) instead of once per forward."""

    calls: tuple[AttendCall, ...]
    memo: dict[Any, Any] = field(default_factory=dict)


Launcher = Callable[[], Any]  # makes one attention call of a forward, its result in its ``out``
Launchers = Callable[[AttendCalls], Sequence[Launcher]]


class Bound:
    """A backend bound to one forward's batch (the model's :class:`BoundAttention`).

    :meth:`launchers` is what a segment runner calls instead: one zero-argument callable per
    attention call of its bucket, resolved once per forward, so the host work between two
    graph replays is the call itself (a backend may give the kernel launch and nothing else)."""

    def __init__(
        self,
        backend: AttentionBackend,
        batch: ForwardBatch,
        attend: Callable[..., torch.Tensor],
        launchers: Launchers | None = None,
    ) -> None:
        self.backend = backend
        self.batch = batch
        self._attend = attend
        self._launchers = launchers
        self.decode = batch.layout.mode is ForwardMode.DECODE

    def launchers(self, calls: AttendCalls) -> Sequence[Launcher]:
        """One launcher per call of ``calls``, valid for this forward only."""
        if self._launchers is not None:
            return self._launchers(calls)
        return [self._into(c) for c in calls.calls]

    def _into(self, c: AttendCall) -> Launcher:
        def launch() -> None:
            res = self._attend(c.q, c.k, c.v, c.key, c.out)
            if res.data_ptr() != c.out.data_ptr() or res.stride() != c.out.stride():
                c.out.copy_(res)

        return launch

    def store(self, k: torch.Tensor, v: torch.Tensor, key: AttentionKey) -> None:
        self.backend.store(k, v, key, self.batch)

    def kv_target(self, key: AttentionKey) -> KVTarget | None:
        spec = self.backend.registry.spec(key)
        if spec.kind == MLA_NEW:
            return None
        cache = self.backend.kv.kv[spec.kv_layer]
        if cache.shape[1] != 2:  # a one-part layout (MLA's latent) is stored its own way
            return None
        return KVTarget(cache, self.batch.out_cache_loc, functools.partial(self.store, key=key))

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._attend(q, k, v, key, out)


def output_buffer(q3: torch.Tensor, out: torch.Tensor | None, num_real: int) -> torch.Tensor:
    """Where attention of q3 (T, Hq, D) writes: ``out`` viewed as heads, or a new tensor. Rows
    past the ``num_real`` live tokens (padding) are zeroed, so a padded row never carries a value
    left over from another batch."""
    res = torch.empty_like(q3) if out is None else out.view(q3.shape)
    if q3.shape[0] > num_real:
        res[num_real:].zero_()
    return res
