"""Attention as an opaque torch custom op, so `torch.compile` splits the graph around it.

The op receives tensors and the (layer id, variant) key; the attention bound to the live batch
(planned once per forward) comes from a context variable that the runner sets around each call.
The variable is scoped to the call (``with attention_context(...)``), not global state: nothing
outside the runner sees it. The op stores this pass's K/V and attends, so the compiled pieces
hold no KV-cache writes of their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from service.model.attention import AttentionKey, BoundAttention

OP_NAME = "capture_service::attention"
_current: ContextVar[BoundAttention | None] = ContextVar("capture_service_attention", default=None)


def direct_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, variant: str
) -> torch.Tensor:
    """What the op does, called without the dispatcher (split graphs call it at replay)."""
    bound = _current.get()
    if bound is None:
        raise RuntimeError("capture_service::attention called outside attention_context")
    key = AttentionKey(layer_id, variant)
    bound.store(k, v, key)
    return bound(q, k, v, key)


@torch.library.custom_op(OP_NAME, mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, variant: str
) -> torch.Tensor:
    out = direct_attention(q, k, v, layer_id, variant)
    # a custom op's output may not alias its inputs; backends return fresh tensors, so the
    # copy is only for one that hands back a view of q, k or v
    aliases = any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                  for t in (q, k, v))  # fmt: skip
    return out.clone() if aliases else out


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, variant: str):
    return torch.empty_like(q)


@contextmanager
def attention_context(bound: BoundAttention) -> Iterator[None]:
    token = _current.set(bound)
    try:
        yield
    finally:
        _current.reset(token)


class OpAttention:
    """The :class:`BoundAttention` a compiled forward calls: one custom op that stores and
    attends (``store`` is deferred to it, so no KV write enters a compiled piece). Compiled
    forwards are prefills."""

    decode = False

    def store(self, k: torch.Tensor, v: torch.Tensor, key: AttentionKey) -> None:
        return None

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return torch.ops.capture_service.attention(q, k, v, key.layer_id, key.variant)


op_attention = OpAttention()
