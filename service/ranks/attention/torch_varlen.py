"""Reference attention in plain torch: one SDPA call per request over its KV row (eager only).

Reads per-request lengths from the batch's host layout, so it cannot run inside a captured
graph; it is the eager path on every device, and the attention between ``breakable`` /
``tc_piecewise`` segment replays on CPU.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from service.ranks.attention.base import AttentionBackend, AttentionKey
from service.ranks.forward_batch import ForwardBatch


def causal_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """q (E, Hq, D) at positions prefix..prefix+E-1 over k/v (prefix+E, Hkv, D) -> (E, Hq, D)."""
    num_q, num_heads = q.shape[0], q.shape[1]
    group = num_heads // k.shape[1]
    if group > 1:  # grouped-query attention: each KV head serves `group` query heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if prefix_len == 0:  # plain causal: lets SDPA pick its flash kernel
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:  # queries sit after a cached prefix: bottom-right aligned causal mask
        key_pos = torch.arange(k.shape[0], device=q.device)
        query_pos = prefix_len + torch.arange(num_q, device=q.device)
        mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)  # (E, prefix+E)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    # out: (Hq, E, D)
    return out.transpose(0, 1)


class TorchVarlenAttention(AttentionBackend):
    name = "torch"
    graph_safe = False

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
        out = torch.zeros_like(q3)  # padded tokens keep zeros
        k_cache, v_cache = self.kv.k[spec.kv_layer], self.kv.v[spec.kv_layer]
        layout = batch.layout
        start = 0
        for row, prefix, new in zip(
            layout.req_pool_indices, layout.prefix_lens, layout.extend_lens, strict=True
        ):
            if new == 0:
                continue
            slots = self.req_to_token.table[row, : prefix + new]
            out[start : start + new] = causal_attend(
                q3[start : start + new], k_cache[slots], v_cache[slots], prefix, spec.scale
            )
            start += new
        return out.view(q.shape[0], -1)
