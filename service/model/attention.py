"""The model's attention contract: what a layer calls, and the metadata each path registers.

A model layer may own several attention paths (DeepSeek's MHA prefill path and MQA decode path
share a layer id). Metadata is therefore keyed by :class:`AttentionKey` = (layer id, variant), and
a backend looks up exactly its key, so one path never receives the other's head metadata
(DESIGN invariant 8). The backends that implement the call live with the ranks
(``service.ranks.attention``); the model knows only this contract.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, order=True)
class AttentionKey:
    layer_id: int
    variant: str = "mha"


# What a path attends over, and for which requests (AttentionSpec.kind):
CACHED = "cached"  # every request, over its KV-cache row (its prefix and this pass's tokens)
MLA_NEW = "mla_new"  # MLA's MHA path: requests without a cached prefix, over this pass's k/v only
MLA_LATENT = "mla_latent"  # MLA's MQA path: requests with a cached prefix, and every decode
# request, over the cached latent entries (values are the keys: one head, k == v)
ATTENTION_KINDS = (CACHED, MLA_NEW, MLA_LATENT)


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention path needs to know: head counts on this rank, head dim, KV layer,
    and what it attends over (``kind``). Outputs are (T, num_heads * head_dim): a path whose
    values are narrower (MLA) gets them zero-padded to ``head_dim`` and reads its columns."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    kv_layer: int
    kind: str = CACHED

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention kind {self.kind!r} is not one of {ATTENTION_KINDS}")


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

    def specs(self) -> list[AttentionSpec]:
        return [self._specs[key] for key in self.keys()]

    def kinds(self) -> set[str]:
        return {spec.kind for spec in self._specs.values()}


@dataclass(frozen=True, eq=False)
class AttendCall:
    """One attention call over fixed tensors, its result written into ``out``: what a layer's
    attention is, stated once per bucket for a segment runner (:meth:`CausalLM.attend_calls`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key: AttentionKey
    out: torch.Tensor


@dataclass(frozen=True, eq=False)
class KVTarget:
    """Where one layer's K/V of this pass go, for a kernel that writes them itself (rotary and
    the store in one, service.model.kernels): the layer's cache (num_slots + 1, 2, Hkv, D), each
    token's slot (T,), and the bound attention's own ``store(k, v)`` for the fallback."""

    cache: torch.Tensor
    loc: torch.Tensor
    store: Callable[[torch.Tensor, torch.Tensor], None]


class BoundAttention(Protocol):
    """Attention bound to one forward's batch: what a model layer calls, in this order.

    ``store`` is token-axis work (each token's K/V to its KV slot), so a segment runner captures
    it inside the segment that produced k and v; the call attends over each request's cached
    prefix and new tokens, and is what runs between segment replays. ``decode`` says whether the
    bound batch is a decode step (a model with a decode-only attention path, MLA, reads it).
    """

    decode: bool

    def store(self, k: torch.Tensor, v: torch.Tensor, key: AttentionKey) -> None:
        """Write this pass's k, v (T, Hkv*D) into the KV cache (an implementation may defer
        it to the call)."""

    def kv_target(self, key: AttentionKey) -> KVTarget | None:
        """Where a kernel may write this pass's K/V of ``key`` itself, instead of :meth:`store`;
        None where it may not (a path that stores nothing or otherwise, a store deferred to the
        call)."""

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
