"""Log-probabilities of tokens under the model (raw logits, before temperature or top-k/top-p),
with the most likely alternatives: what OpenAI-style ``logprobs`` and ``echo`` report."""

from __future__ import annotations

import torch

from service.commands import TokenLogprob


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top: int) -> list[TokenLogprob]:
    """logits (N, V), token_ids (N,) -> each token's logprob and the ``top`` alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, token_ids.view(-1, 1)).view(-1)
    if top > 0:
        values, ids = lp.topk(top, dim=-1)
        pairs = list(zip(ids.tolist(), values.tolist(), strict=True))
    else:
        pairs = [([], [])] * lp.shape[0]
    return [
        TokenLogprob(t, v, tuple(zip(i, x, strict=True)))
        for t, v, (i, x) in zip(token_ids.tolist(), chosen.tolist(), pairs, strict=True)
    ]
