"""Graph-safe attention in plain torch over a fixed request axis of S slots.

Every shape is fixed by the bucket (T tokens), the slot count S and ``context_length``; every
length is read from device tensors. That is what the ``full`` backend needs: the same kernels
replay for any live layout. Queries are gathered into (S, Qmax, H, D) with
``Qmax = min(T, context_length)`` (no request has more new tokens), keys into (S, ctx, H, D) from
each slot's request-to-token row, and outputs are scattered back to the token axis.

Zero-length sentinel slots and padded query rows are allowed key 0 so that no softmax row is
empty (no NaN); their outputs go to a discarded row, so they never write a live token.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from service.ranks.attention.base import AttentionBackend, AttentionKey
from service.ranks.forward_batch import ForwardBatch


class TorchSlotAttention(AttentionBackend):
    name = "torch_slots"
    graph_safe = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        spec = self.registry.spec(key)
        q3, k3, v3 = self._split_heads(q, k, v, spec)
        self.kv.store(spec.kv_layer, batch.out_cache_loc, k3, v3)
        num_tokens, num_heads, head_dim = q3.shape
        ctx = self.req_to_token.context_length
        q_max = min(num_tokens, ctx)
        dev = q.device

        q_off = torch.arange(q_max, device=dev)  # (Qmax,)
        q_valid = q_off.unsqueeze(0) < batch.extend_lens.unsqueeze(1)  # (S, Qmax)
        q_index = (batch.extend_start_loc.unsqueeze(1) + q_off).clamp_(max=num_tokens - 1)
        queries = q3[q_index]  # (S, Qmax, Hq, D)

        rows = self.req_to_token.table.index_select(0, batch.req_pool_indices)  # (S, ctx)
        keys = self.kv.k[spec.kv_layer][rows]  # (S, ctx, Hkv, D)
        values = self.kv.v[spec.kv_layer][rows]
        group = num_heads // spec.num_kv_heads
        if group > 1:
            keys = keys.repeat_interleave(group, dim=2)
            values = values.repeat_interleave(group, dim=2)

        k_pos = torch.arange(ctx, device=dev)  # (ctx,)
        q_pos = batch.prefix_lens.unsqueeze(1) + q_off  # (S, Qmax)
        mask = k_pos.view(1, 1, ctx) <= q_pos.unsqueeze(2)  # causal within the request
        mask = mask | (~q_valid.unsqueeze(2) & (k_pos.view(1, 1, ctx) == 0))  # no empty rows
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),  # (S, Hq, Qmax, D)
            keys.transpose(1, 2),  # (S, Hq, ctx, D)
            values.transpose(1, 2),
            attn_mask=mask.unsqueeze(1),  # (S, 1, Qmax, ctx)
            scale=spec.scale,
        ).transpose(1, 2)  # (S, Qmax, Hq, D)

        # Scatter back; invalid rows land on a spare row T that is cut off.
        target = torch.where(q_valid, q_index, torch.full_like(q_index, num_tokens))
        flat = torch.zeros(num_tokens + 1, num_heads, head_dim, dtype=out.dtype, device=dev)
        flat.index_copy_(0, target.reshape(-1), out.reshape(-1, num_heads, head_dim))
        return flat[:num_tokens].reshape(num_tokens, num_heads * head_dim)
