"""The model's attention contract: what a layer calls, and the metadata each path registers.

A model layer may own several attention paths (DeepSeek's MHA prefill path and MQA decode path
share a layer id). Metadata is therefore keyed by :class:`AttentionKey` = (layer id, variant), and
a backend looks up exactly its key, so one path never receives the other's head metadata
(DESIGN invariant 8). The backends that implement the call live with the ranks
(``service.ranks.attention``); the model knows only this contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


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


class BoundAttention(Protocol):
    """Attention bound to one forward's batch: what a model layer calls, in this order.

    ``store`` is token-axis work (each token's K/V to its KV slot), so a segment runner captures
    it inside the segment that produced k and v; the call attends over each request's cached
    prefix and new tokens, and is what runs between segment replays.
    """

    def store(self, k: torch.Tensor, v: torch.Tensor, key: AttentionKey) -> None:
        """Write this pass's k, v (T, Hkv*D) into the KV cache (an implementation may defer
        it to the call)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (T, Hq*D), k, v (T, Hkv*D) -> (T, Hq*D), written into ``out`` when it is given."""
        ...
