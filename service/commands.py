"""The typed messages between the coordinator and the ranks (pure, picklable, no tensors).

The coordinator decides everything that must be identical across ranks (request rows, KV
slots, the graph decision) and sends one command; every rank executes it in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from service.buckets import ReplayDecision
from service.decode_sizes import DecodeDecision
from service.sampling import SamplingParams

GraphKind = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class GraphRecord:
    """What one prefill batch did: replayed a bucket (and on what) or ran eagerly, and why."""

    num_tokens: int
    num_requests: int
    graph_hit: bool
    bucket: int | None
    padded_tokens: int
    graph_kind: GraphKind | None  # "cuda": a real CUDA graph; "cpu": static-buffer replay on CPU
    miss_reason: str | None

    @staticmethod
    def from_decision(
        decision: ReplayDecision, num_tokens: int, num_requests: int, kind: GraphKind
    ) -> GraphRecord:
        return GraphRecord(
            num_tokens=num_tokens,
            num_requests=num_requests,
            graph_hit=decision.hit,
            bucket=decision.bucket,
            padded_tokens=decision.padded_tokens,
            graph_kind=kind if decision.hit else None,
            miss_reason=decision.miss_reason,
        )

    @property
    def cuda_graph(self) -> bool:
        return self.graph_hit and self.graph_kind == "cuda"

    def summary(self) -> str:
        if self.graph_hit:
            return f"hit (bucket {self.bucket}, {self.graph_kind})"
        return f"miss ({self.miss_reason})"

    def to_json(self) -> dict:
        return {
            "num_tokens": self.num_tokens,
            "num_requests": self.num_requests,
            "graph_hit": self.graph_hit,
            "bucket": self.bucket,
            "padded_tokens": self.padded_tokens,
            "graph_kind": self.graph_kind,
            "miss_reason": self.miss_reason,
        }


@dataclass(frozen=True)
class DecodeRecord:
    """What one decode step did: replayed a captured size (padded how much) or ran eagerly."""

    batch_size: int
    graph_hit: bool
    size: int | None
    padded: int
    graph_kind: GraphKind | None
    miss_reason: str | None

    @staticmethod
    def from_decision(decision: DecodeDecision, batch_size: int, kind: GraphKind) -> DecodeRecord:
        return DecodeRecord(
            batch_size=batch_size,
            graph_hit=decision.hit,
            size=decision.size,
            padded=decision.padded,
            graph_kind=kind if decision.hit else None,
            miss_reason=decision.miss_reason,
        )


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, and the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class PromptScore:
    """Score a prefill chunk's prompt tokens: ``top`` alternatives each, and ``next_token``, the
    prompt token after the chunk (None at the prompt's end), scored by the chunk's last row."""

    top: int
    next_token: int | None


@dataclass(frozen=True)
class RowWrite:
    """req_to_token[row, start : start + len(slots)] = slots"""

    row: int
    start: int
    slots: tuple[int, ...]


@dataclass(frozen=True)
class ForwardCommand:
    is_prefill: bool
    req_pool_indices: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    input_ids: tuple[int, ...]
    out_cache_loc: tuple[int, ...]
    row_writes: tuple[RowWrite, ...]
    sampling: tuple[SamplingParams, ...]
    steps: tuple[int, ...]  # tokens generated so far per request (seeds sampling)
    decision: ReplayDecision | None  # the graph decision for a prefill, made by the coordinator
    decode: DecodeDecision | None = None  # the graph decision for a decode step
    return_logits: bool = False
    # prefill of requests that want prompt log-probabilities: per request, what to score
    prompt_scores: tuple[PromptScore | None, ...] | None = None


@dataclass(frozen=True)
class ForwardResult:
    next_token_ids: tuple[int, ...]
    record: GraphRecord | None  # prefill only
    logits: object | None = None  # (B, V) float32 CPU tensor when asked for
    decode_record: DecodeRecord | None = None  # decode only
    logprobs: tuple[TokenLogprob | None, ...] = ()  # per request: its sampled token's
    # per request: its chunk's prompt tokens after the first, and the one after the chunk
    prompt_logprobs: tuple[tuple[TokenLogprob, ...] | None, ...] = ()
