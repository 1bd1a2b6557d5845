"""Token sampling from last-token logits: greedy, temperature, top-k, top-p, seeded per request.

Every rank samples the same logits with the same seeds, so all ranks agree on the next tokens
without another collective.
"""

from __future__ import annotations

import torch

from service.sampling import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """logits (B, V) float32; ``steps[i]`` = tokens request i generated so far (seeds the draw)."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i].float().cpu() / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.shape[-1])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # always keeps the top token
            mask = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, order[keep], True)
            probs = torch.where(mask, probs, torch.zeros_like(probs))
            probs = probs / probs.sum()
        gen = torch.Generator().manual_seed(((p.seed or 0) * 1_000_003 + steps[i]) & 0x7FFFFFFF)
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    return out
