"""The attention-backend interface and the per-(layer, variant) metadata registry.

A model layer may own several attention paths (DeepSeek's MHA prefill path and MQA decode path
share a layer id). Metadata is therefore keyed by :class:`AttentionKey` = (layer id, variant), and
a backend's ``forward`` looks up exactly its key, so one path never receives the other's head
metadata (DESIGN invariant 8).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.ranks.forward_batch import ForwardBatch
from service.ranks.kv_pool import ReqToTokenPool, TokenKVPool


@dataclass(frozen=True, order=True)
class AttentionKey:
    layer_id: int
    variant: str = "mha"


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention path needs to know: head counts on this rank, head dim, KV layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    kv_layer: int


class AttentionRegistry:
    """Every attention path of the model, registered once at model construction."""

    def __init__(self) -> None:
        self._specs: dict[AttentionKey, AttentionSpec] = {}

    def register(self, key: AttentionKey, spec: AttentionSpec) -> None:
        if key in self._specs and self._specs[key] != spec:
            raise ValueError(f"attention path {key} registered twice with different specs")
        self._specs[key] = spec

    def spec(self, key: AttentionKey) -> AttentionSpec:
        try:
            return self._specs[key]
        except KeyError:
            raise KeyError(
                f"attention path {key} is not registered; registered: {sorted(self._specs)}"
            ) from None

    def keys(self) -> list[AttentionKey]:
        return sorted(self._specs)


# What a model calls for attention: (q (T, Hq*D), k (T, Hkv*D), v (T, Hkv*D), key) -> (T, Hq*D)
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionKey], torch.Tensor]


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

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        batch: ForwardBatch,
    ) -> torch.Tensor: ...

    def prepare(self, batch: ForwardBatch, bucket: int) -> None:
        """Host-side planning before the graph of ``bucket`` is captured or replayed over
        ``batch`` (outside the graph). Backends whose metadata is computed in-graph need none."""
        return None

    def forget(self, bucket: int) -> None:
        """Drop what ``prepare`` keeps for ``bucket`` (its capture failed on another rank)."""
        return None

    def bind(self, batch: ForwardBatch) -> AttentionFn:
        """The attention function a model forward of ``batch`` calls (once per forward, so
        per-batch planning happens once, not once per layer)."""

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: AttentionKey):
            return self.forward(q, k, v, key, batch)

        return attend

    def _store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        batch: ForwardBatch,
    ) -> tuple[AttentionSpec, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The path's metadata, heads split out, and this pass's K/V written to the pool."""
        spec = self.registry.spec(key)
        q3, k3, v3 = self._split_heads(q, k, v, spec)
        self.kv.store(spec.kv_layer, batch.out_cache_loc, k3, v3)
        return spec, q3, k3, v3

    def _split_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = q.shape[0]
        if q.shape[-1] != spec.num_heads * spec.head_dim:
            raise ValueError(
                f"query of width {q.shape[-1]} does not match its path's metadata "
                f"({spec.num_heads} heads x {spec.head_dim})"
            )
        return (
            q.view(t, spec.num_heads, spec.head_dim),
            k.view(t, spec.num_kv_heads, spec.head_dim),
            v.view(t, spec.num_kv_heads, spec.head_dim),
        )
