"""Decode attention in plain torch, batched over requests: no Python loop, graph-safe.

One query per request attends over its KV row: keys and values are gathered from the
request-to-token row up to a fixed ``width`` (``context_length`` inside a captured graph, the
batch's longest sequence when eager) and masked to each request's length, read from device
tensors. Padded decode slots (service.padding) have length 1 over key 0 of the sentinel row: a
harmless read whose output is discarded.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from service.model.attention import AttentionKey, BoundAttention
from service.ranks.attention.base import AttentionBackend, Bound, PlannedAttention
from service.ranks.forward_batch import ForwardBatch


def decode_attend(
    backend: AttentionBackend, q: torch.Tensor, key: AttentionKey, rows: torch.Tensor,
    mask: torch.Tensor, out: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """q (B, Hq*D) over the KV slots ``rows`` (B, W) where ``mask`` (B, 1, 1, W) -> (B, Hq*D)."""
    spec, q3 = backend.heads(q, key)
    keys = backend.kv.k[spec.kv_layer][rows]  # (B, W, Hkv, D)
    values = backend.kv.v[spec.kv_layer][rows]
    if spec.num_kv_heads == 1:  # one shared KV head (MLA's latent path): the query heads
        # become one head's query rows, so no kernel copies the keys once per query head
        res = F.scaled_dot_product_attention(
            q3.unsqueeze(1),  # (B, 1, Hq, D)
            keys.transpose(1, 2),  # (B, 1, W, D)
            values.transpose(1, 2),
            attn_mask=mask,  # (B, 1, 1, W): the same keys for every query row
            scale=spec.scale,
        ).reshape(q.shape[0], -1)  # (B, Hq*D)
        return res if out is None else out.copy_(res)
    res = F.scaled_dot_product_attention(
        q3.unsqueeze(2),  # (B, Hq, 1, D)
        keys.transpose(1, 2),  # (B, Hkv, W, D)
        values.transpose(1, 2),
        attn_mask=mask,
        scale=spec.scale,
        enable_gqa=spec.num_heads != spec.num_kv_heads,
    ).reshape(q.shape[0], -1)  # (B, Hq*D)
    return res if out is None else out.copy_(res)


def decode_rows(
    backend: AttentionBackend, batch: ForwardBatch, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(KV slots (B, W), mask (B, 1, 1, W)) of a decode batch: request i reads positions
    0 .. prefix_lens[i] of its row (its cached prefix and the new token)."""
    rows = backend.req_to_token.table.index_select(0, batch.req_pool_indices)[:, :width]
    k_pos = torch.arange(width, device=rows.device)
    mask = k_pos.unsqueeze(0) <= batch.prefix_lens.unsqueeze(1)  # (B, W)
    return rows, mask.view(mask.shape[0], 1, 1, width)


class TorchDecodeAttention(PlannedAttention):
    """The graph-safe decode attention of decode graphs (fixed width: context_length)."""

    name = "torch_decode"
    graph_safe = True

    def bind(self, batch: ForwardBatch, width: int | None = None) -> BoundAttention:
        rows, mask = decode_rows(self, batch, width or self.req_to_token.context_length)

        def attend(q, k, v, key, out):
            return decode_attend(self, q, key, rows, mask, out)

        return Bound(self, batch, attend)
