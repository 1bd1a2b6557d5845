"""Reference attention in plain torch: one SDPA call per request over its KV row (eager only).

Reads per-request lengths from the batch's host layout, so it cannot run inside a captured
graph; it is the eager path on every device, and the attention between ``breakable`` /
``tc_piecewise`` segment replays on CPU. Decode batches are batched (service.ranks.attention.
torch_decode).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from service.model.attention import MLA_LATENT, MLA_NEW, AttentionKey, BoundAttention
from service.ranks.attention.base import AttentionBackend, Bound, output_buffer
from service.ranks.attention.torch_decode import decode_attend, decode_rows
from service.ranks.forward_batch import ForwardBatch, ForwardMode


def causal_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """q (E, Hq, D) at positions prefix..prefix+E-1 over k/v (prefix+E, Hkv, D) -> (E, Hq, D)."""
    num_q = q.shape[0]
    # SDPA's fused kernels need 4-D (batch, heads, seq, dim) inputs; 3-D falls back to the
    # math kernel, which materialises the whole score matrix.
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, L, D)
    gqa = q.shape[1] != k.shape[1]  # grouped-query attention: KV heads serve several q heads
    if prefix_len == 0:  # plain causal: lets SDPA pick its flash kernel
        out = F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:  # queries sit after a cached prefix: bottom-right aligned causal mask
        key_pos = torch.arange(k.shape[0], device=q.device)
        query_pos = prefix_len + torch.arange(num_q, device=q.device)
        mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # (E, prefix+E)
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    return out[0].transpose(0, 1)  # (E, Hq, D)


class TorchVarlenAttention(AttentionBackend):
    """Eager attention: per request for prefill; decode batches go to the batched decode
    attention over the batch's longest sequence (no loop over requests)."""

    name = "torch"
    graph_safe = False

    def bind(self, batch: ForwardBatch) -> BoundAttention:
        if batch.layout.mode is not ForwardMode.DECODE:
            return super().bind(batch)
        rows, mask = decode_rows(self, batch, max(batch.layout.seq_lens))

        def attend(q, k, v, key, out):
            return decode_attend(self, q, key, rows, mask, out)

        return Bound(self, batch, attend)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        batch: ForwardBatch,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        spec, q3 = self.heads(q, key)
        layout = batch.layout
        res = output_buffer(q3, out, layout.num_tokens)
        k_cache, v_cache = self.kv.k[spec.kv_layer], self.kv.v[spec.kv_layer]
        t = k.shape[0]
        start = 0
        for row, prefix, new in zip(
            layout.req_pool_indices, layout.prefix_lens, layout.extend_lens, strict=True
        ):
            if new == 0:
                continue
            end = start + new
            if (spec.kind == MLA_NEW and prefix > 0) or (spec.kind == MLA_LATENT and prefix == 0):
                res[start:end].zero_()  # the layer's other path serves this request
            elif spec.kind == MLA_NEW:  # this pass's keys and values only: no cached prefix
                k3 = k.view(t, spec.num_kv_heads, spec.head_dim)
                v3 = v.view(t, spec.num_kv_heads, spec.head_dim)
                res[start:end] = causal_attend(
                    q3[start:end], k3[start:end], v3[start:end], 0, spec.scale
                )
            else:
                slots = self.req_to_token.table[row, : prefix + new]
                res[start:end] = causal_attend(
                    q3[start:end], k_cache[slots], v_cache[slots], prefix, spec.scale
                )
            start = end
        return res.view(q.shape[0], -1)
