"""Graph-safe attention in plain torch over a fixed request axis of S slots.

Every shape is fixed by the bucket (T tokens), the slot count S and ``context_length``; every
length is read from device tensors. That is what the ``full`` backend needs: the same kernels
replay for any live layout. Queries are gathered into (S, Qmax, H, D) with
``Qmax = min(T, context_length)`` (no request has more new tokens), keys into (S, ctx, Hkv, D)
from each slot's request-to-token row, and outputs are scattered back to the token axis.

The layout-only part (gather and scatter indices, the mask) is computed once per forward in
:meth:`TorchSlotAttention.bind`, not once per layer; inside a captured graph it is part of the
graph and recomputed from the static buffers at every replay.

Zero-length sentinel slots and padded query rows are allowed key 0 so that no softmax row is
empty (no NaN); their outputs go to a discarded row, so they never write a live token.

MLA's two prefill paths (service.model.attention kinds) select their requests on the device:
the MHA path serves slots without a cached prefix and attends over this pass's own keys and
values (gathered like the queries), the MQA path serves slots with a prefix over the cached
latent; each leaves the other's rows zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from service.model.attention import CACHED, MLA_LATENT, MLA_NEW, AttentionKey, BoundAttention
from service.ranks.attention.base import Bound, PlannedAttention
from service.ranks.forward_batch import ForwardBatch


@dataclass(frozen=True)
class SlotLayout:
    q_index: torch.Tensor  # (S, Qmax) token of each query row (clamped)
    target: torch.Tensor  # (S*Qmax,) where each row's output goes; T for invalid rows
    rows: torch.Tensor  # (S, ctx) KV slots of each slot's request
    mask: torch.Tensor  # (S, 1, Qmax, ctx) True where a query may attend a key
    # per attention kind other than CACHED: (target, mask) of the requests that kind serves
    by_kind: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def for_kind(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.target, self.mask) if kind == CACHED else self.by_kind[kind]


class TorchSlotAttention(PlannedAttention):
    name = "torch_slots"
    graph_safe = True

    def layout(self, batch: ForwardBatch, num_tokens: int) -> SlotLayout:
        ctx = self.req_to_token.context_length
        q_max = min(num_tokens, ctx)
        dev = batch.input_ids.device
        q_off = torch.arange(q_max, device=dev)  # (Qmax,)
        q_valid = q_off.unsqueeze(0) < batch.extend_lens.unsqueeze(1)  # (S, Qmax)
        q_index = (batch.extend_start_loc.unsqueeze(1) + q_off).clamp_(max=num_tokens - 1)
        k_pos = torch.arange(ctx, device=dev).view(1, 1, ctx)
        q_pos = (batch.prefix_lens.unsqueeze(1) + q_off).unsqueeze(2)  # (S, Qmax, 1)
        discard = torch.full_like(q_index, num_tokens)

        def masked(valid: torch.Tensor, allowed: torch.Tensor, first_key: torch.Tensor):
            # rows outside ``valid`` may see key 0 only (no empty softmax row) and are discarded
            mask = allowed | (~valid.unsqueeze(2) & first_key)
            return torch.where(valid, q_index, discard).reshape(-1), mask.unsqueeze(1)

        target, mask = masked(q_valid, k_pos <= q_pos, k_pos == 0)
        by_kind: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        kinds = self.registry.kinds()
        has_prefix = (batch.prefix_lens > 0).unsqueeze(1)  # (S, 1)
        if MLA_LATENT in kinds:
            by_kind[MLA_LATENT] = masked(q_valid & has_prefix, k_pos <= q_pos, k_pos == 0)
        if MLA_NEW in kinds:  # keys are the slot's own new tokens: (S, Qmax, Qmax)
            k_off = q_off.view(1, 1, q_max)
            causal = k_off <= q_off.view(1, q_max, 1)
            by_kind[MLA_NEW] = masked(q_valid & ~has_prefix, causal, k_off == 0)
        return SlotLayout(
            q_index=q_index,
            target=target,
            rows=self.req_to_token.table.index_select(0, batch.req_pool_indices),
            mask=mask,
            by_kind=by_kind,
        )

    def bind(self, batch: ForwardBatch) -> BoundAttention:
        layout = self.layout(batch, batch.input_ids.shape[0])

        def attend(q, k, v, key, out):
            return self._attend(q, k, v, key, layout, out)

        return Bound(self, batch, attend)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        layout: SlotLayout,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        spec, q3 = self.heads(q, key)
        num_tokens, num_heads, head_dim = q3.shape
        target, mask = layout.for_kind(spec.kind)
        queries = q3[layout.q_index]  # (S, Qmax, Hq, D)
        if spec.kind == MLA_NEW:  # this pass's own keys and values: (S, Qmax, Hkv, D)
            keys = k.view(num_tokens, spec.num_kv_heads, head_dim)[layout.q_index]
            values = v.view(num_tokens, spec.num_kv_heads, head_dim)[layout.q_index]
        else:
            keys = self.kv.k[spec.kv_layer][layout.rows]  # (S, ctx, Hkv, D)
            values = self.kv.v[spec.kv_layer][layout.rows]
        res = F.scaled_dot_product_attention(
            queries.transpose(1, 2),  # (S, Hq, Qmax, D)
            keys.transpose(1, 2),  # (S, Hkv, ctx or Qmax, D)
            values.transpose(1, 2),
            attn_mask=mask,
            scale=spec.scale,
            enable_gqa=num_heads != spec.num_kv_heads,
        ).transpose(1, 2)  # (S, Qmax, Hq, D)
        flat = torch.zeros(num_tokens + 1, num_heads, head_dim, dtype=res.dtype, device=q.device)
        flat.index_copy_(0, target, res.reshape(-1, num_heads, head_dim))
        result = flat[:num_tokens].reshape(num_tokens, num_heads * head_dim)
        if out is None:
            return result
        return out.copy_(result)
