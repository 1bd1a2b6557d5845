"""Attention as an opaque torch custom op, so `torch.compile` splits the graph around it.

Two ops per attention call: ``capture_service::store_kv`` writes this pass's K/V into the layer's
cache tensor (an input, so pieces of different layers are the same function of their inputs and
share one compile) at the static KV slots and returns an empty token, and
``capture_service::attention`` takes that token as an input and attends. The token orders the
two (the store's effect is not an output anyone reads, so without it a compiler could drop it)
and keeps the store out of the attention node: when the traced graph is split at attention, the
store lands at the end of the piece before it and is captured in that piece's graph, so the host
work between two piece replays is the attention launch alone.

When K and V have equal widths and go to a two-part cache (Llama's grouped-query attention), the
pair is ``capture_service::store_kv_qkv`` and ``capture_service::attention_qkv`` over q, K and V
as one (T, Wq + 2W) tensor, the rotated qkv projection they are column slices of: one piece
output, one kernel that writes it, and one store kernel for K and V (``store_entries`` on its
two adjacent column ranges). Separate outputs cost a kernel each: on the H200, session 27
measured three for q rotated, k rotated and the K/V pair joined.

The attention op finds the attention bound to the live batch (planned once per forward) in a
context variable that the runner sets around each call (``with attention_context(...)``), scoped
to the call, not global state. The runner may also hand over where attention writes its output
(buffers it shares between pieces), so the next piece reads the output in place instead of
copying it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from service.model.attention import AttentionKey, BoundAttention, KVTarget
from service.ranks.kv_pool import store_entries

OP_NAME = "capture_service::attention"
STORE_OP_NAME = "capture_service::store_kv"
# the same over q, K and V as one (T, Wq + 2W) tensor (the module docstring says when)
QKV_OP_NAME = "capture_service::attention_qkv"
QKV_STORE_OP_NAME = "capture_service::store_kv_qkv"

# (q, key) -> where attention of q writes, or None for a fresh tensor
OutputFor = Callable[[torch.Tensor, AttentionKey], torch.Tensor | None]


@dataclass(frozen=True)
class AttentionCall:
    bound: BoundAttention
    output_for: OutputFor | None = None


_current: ContextVar[AttentionCall | None] = ContextVar("capture_service_attention", default=None)
_keys: dict[tuple[int, str], AttentionKey] = {}


def _key(layer_id: int, variant: str) -> AttentionKey:
    key = _keys.get((layer_id, variant))
    if key is None:
        key = _keys[(layer_id, variant)] = AttentionKey(layer_id, variant)
    return key


def _call() -> AttentionCall:
    call = _current.get()
    if call is None:
        raise RuntimeError("capture_service attention ops called outside attention_context")
    return call


def direct_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    variant: str,
    stored: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the attention op does, called without the dispatcher (split graphs call it at
    replay). The cache already holds this pass's K/V (``stored``, the store op's token)."""
    call = _call()
    key = _key(layer_id, variant)
    out = call.output_for(q, key) if call.output_for is not None else None
    return call.bound(q, k, v, key, out)


# Declared without mutated arguments: the cache is written for attention outside the compiled
# piece to read, nothing inside the piece reads it, and a declared mutation would have the
# compiler functionalize (copy) a whole layer's cache. The returned token keeps the call alive.
@torch.library.custom_op(STORE_OP_NAME, mutates_args=())
def store_kv_op(
    k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, loc: torch.Tensor
) -> torch.Tensor:
    return _store(k, v, kv, loc)


def _store(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    """K and V (T, Hkv*D) into the layer's cache ``kv`` at the slots ``loc``; the empty token
    the attention op takes. K and V side by side in every row (packed) are one kernel
    (``store_entries``)."""
    t, heads, dim = k.shape[0], kv.shape[2], kv.shape[3]
    store_entries(kv, loc, k.view(t, heads, dim), v.view(t, heads, dim))
    return k.new_empty(0)


@store_kv_op.register_fake
def _(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, loc: torch.Tensor):
    return k.new_empty(0)


@torch.library.custom_op(OP_NAME, mutates_args=())
def attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    variant: str,
    stored: torch.Tensor,
) -> torch.Tensor:
    return _unaliased(direct_attention(q, k, v, layer_id, variant, stored), q, k, v)


def _unaliased(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``out``, copied only if it shares memory with an input: a custom op's output may not
    alias its inputs; backends return fresh tensors or the runner's output buffers, so the copy
    is only for one that hands back a view of an input."""
    aliases = any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                  for t in inputs)  # fmt: skip
    return out.clone() if aliases else out


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, variant: str, stored):
    return torch.empty_like(q)


def unpack(qkv: torch.Tensor, q_width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, K and V of a packed (T, Wq + 2W) tensor, as column views (no copy)."""
    w = (qkv.shape[1] - q_width) // 2
    return qkv[:, :q_width], qkv[:, q_width : q_width + w], qkv[:, q_width + w :]


def direct_attention_qkv(
    qkv: torch.Tensor, q_width: int, layer_id: int, variant: str, stored: torch.Tensor
) -> torch.Tensor:
    """:func:`direct_attention` over packed q, K, V (what the split graph calls at replay)."""
    return direct_attention(*unpack(qkv, q_width), layer_id, variant, stored)


@torch.library.custom_op(QKV_STORE_OP_NAME, mutates_args=())
def store_kv_qkv_op(
    qkv: torch.Tensor, q_width: int, kv: torch.Tensor, loc: torch.Tensor
) -> torch.Tensor:
    _, k, v = unpack(qkv, q_width)
    return _store(k, v, kv, loc)


@store_kv_qkv_op.register_fake
def _(qkv: torch.Tensor, q_width: int, kv: torch.Tensor, loc: torch.Tensor):
    return qkv.new_empty(0)


@torch.library.custom_op(QKV_OP_NAME, mutates_args=())
def attention_qkv_op(
    qkv: torch.Tensor, q_width: int, layer_id: int, variant: str, stored: torch.Tensor
) -> torch.Tensor:
    return _unaliased(direct_attention_qkv(qkv, q_width, layer_id, variant, stored), qkv)


@attention_qkv_op.register_fake
def _(qkv: torch.Tensor, q_width: int, layer_id: int, variant: str, stored):
    return qkv.new_empty(qkv.shape[0], q_width)


@contextmanager
def attention_context(bound: BoundAttention, output_for: OutputFor | None = None) -> Iterator[None]:
    token = _current.set(AttentionCall(bound, output_for))
    try:
        yield
    finally:
        _current.reset(token)


class OpAttention:
    """The :class:`BoundAttention` a compiled forward calls: per attention call, the store op
    into ``cache_for(key)`` (None: the path stores nothing, MLA's MHA path) at the first T of
    the static KV slots ``loc``, then the attention op (``store`` is deferred to the call, which
    emits both, so the store sits right before its attention in the trace). Compiled forwards
    are prefills."""

    decode = False

    def __init__(
        self, cache_for: Callable[[AttentionKey], torch.Tensor | None], loc: torch.Tensor
    ) -> None:
        self.cache_for = cache_for
        self.loc = loc
        # keys whose K/V the rotary kernel stored while this forward was traced (kv_target)
        self._stored_by_kernel: set[AttentionKey] = set()

    def store(self, k: torch.Tensor, v: torch.Tensor, key: AttentionKey) -> None:
        return None

    def kv_target(self, key: AttentionKey) -> KVTarget | None:
        """The cache and static slots for a kernel that rotates and stores in one op
        (service.model.rope_store_triton): then the call emits no store op. Should the kernels
        fall back to the plain rotary, they call ``store``, and the call stores as usual."""
        kv = self.cache_for(key)
        if kv is None or kv.shape[1] != 2:
            return None
        self._stored_by_kernel.add(key)
        return KVTarget(kv, self.loc, lambda k, v: self._stored_by_kernel.discard(key))

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ops = torch.ops.capture_service
        if key in self._stored_by_kernel:  # stored already, by the op that made q, K and V
            self._stored_by_kernel.discard(key)
            qkv = torch.cat([q, k, v], dim=-1)  # the op's output itself (see below)
            return ops.attention_qkv(qkv, q.shape[1], key.layer_id, key.variant, qkv.new_empty(0))
        kv = self.cache_for(key)
        loc = self.loc[: k.shape[0]]
        if (
            kv is not None and kv.shape[1] == 2 and k.shape == v.shape
            and q.dtype == k.dtype == v.dtype and q.shape[0] == k.shape[0]
        ):  # fmt: skip
            # q, K and V leave the piece as one tensor. They are the slices of one split of the
            # rotated projection (Kernels.rope_qkv), and inductor replaces a cat of a split's
            # slices, all in order, by the split tensor itself (a post-grad pattern), so this
            # cat costs nothing; were they anything else, it is a copy, still correct.
            qkv = torch.cat([q, k, v], dim=-1)
            stored = ops.store_kv_qkv(qkv, q.shape[1], kv, loc)
            return ops.attention_qkv(qkv, q.shape[1], key.layer_id, key.variant, stored)
        stored = k.new_empty(0) if kv is None else ops.store_kv(k, v, kv, loc)
        return ops.attention(q, k, v, key.layer_id, key.variant, stored)
