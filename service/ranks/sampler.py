"""Token sampling from last-token logits, batched: greedy, temperature, top-k, top-p, seeded.

All rows are sampled together on the logits' device, and the chosen ids cross to the host in one
copy per step. A sampled row draws with the Gumbel-max trick from uniforms that are a hash of
(request seed, step, token id): the draw depends only on the request, never on its batch
neighbours or on the device's random state, so every rank samples the same tokens from the same
logits without another collective, and a request's seeded output is reproducible.
"""

from __future__ import annotations

import torch

from service.sampling import SamplingParams

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**31: every product of a 32-bit value with it fits in int64


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (two multiply-xorshift rounds), in int64 without overflow."""
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK32
    return x ^ (x >> 16)


def seeded_uniform(keys: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) uniforms in (0, 1), float64: a hash of each row's key and the column."""
    cols = torch.arange(width, device=keys.device, dtype=torch.int64)
    x = _hash32((_hash32(keys & _MASK32).unsqueeze(1) + cols * 0x27D4EB2D) & _MASK32)
    return (x.double() + 0.5) / 2.0**32


def sample_ids(
    logits: torch.Tensor, params: list[SamplingParams], steps: list[int]
) -> torch.Tensor:
    """logits (B, V) float32 -> (B,) int64 token ids on the logits' device.

    ``steps[i]`` is how many tokens request i generated so far: with its seed, it keys the draw.
    """
    ids = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return ids
    dev, vocab = logits.device, logits.shape[-1]
    sel = [params[i] for i in rows]

    def col(values: list) -> torch.Tensor:
        return torch.tensor(values, device=dev)

    index = col(rows)
    scaled = logits.index_select(0, index) / col([p.temperature for p in sel]).unsqueeze(1)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in sel]
    if any(k < vocab for k in top_k):  # keep the k largest (ties at the k-th kept)
        kth = scaled.topk(max(top_k), dim=-1).values.gather(1, col(top_k).unsqueeze(1) - 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    top_p = col([p.top_p for p in sel])
    if bool((top_p < 1.0).any()):  # the smallest set whose mass reaches top_p (top token kept)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p.unsqueeze(1)
        mask = torch.zeros_like(keep).scatter_(1, order, keep)
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    keys = col([((p.seed or 0) * 1_000_003 + steps[i]) for p, i in zip(sel, rows, strict=True)])
    gumbel = -torch.log(-torch.log(seeded_uniform(keys, vocab)))
    choice = (torch.log(probs.double()) + gumbel).argmax(dim=-1)
    return ids.index_copy(0, index, choice)


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """:func:`sample_ids`, brought to the host in one copy."""
    return sample_ids(logits, params, steps).tolist()
