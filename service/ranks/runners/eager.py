"""Eager prefill: the model forward as is; also the fallback when no bucket is legal."""

from __future__ import annotations

import torch

from service.buckets import ReplayDecision
from service.commands import GraphKind
from service.model.llama import CausalLM
from service.ranks.attention.base import AttentionBackend
from service.ranks.forward_batch import ForwardBatch
from service.ranks.runners.base import PrefillRunner


class EagerRunner(PrefillRunner):
    name = "eager"

    def __init__(self, model: CausalLM, attention: AttentionBackend) -> None:
        self.model = model
        self.attention = attention

    @property
    def graph_kind(self) -> GraphKind | None:
        return None

    def run(self, batch: ForwardBatch, decision: ReplayDecision) -> torch.Tensor:
        return self.model(batch.input_ids, batch.positions, self.attention.bind(batch))
