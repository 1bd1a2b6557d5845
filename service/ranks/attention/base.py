"""The attention-backend interface: store K/V into the pool and attend, per (layer, variant).

The model's side of the contract (:class:`AttentionKey`, :class:`AttentionSpec`, the registry,
the attend function type) lives in :mod:`service.model.attention`; backends implement it here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from service.model.attention import AttentionFn, AttentionKey, AttentionRegistry, AttentionSpec
from service.ranks.forward_batch import ForwardBatch
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
