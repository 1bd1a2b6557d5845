"""One request as the scheduler tracks it, and why it finished (typed)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from service.commands import GraphRecord, TokenLogprob
from service.sampling import SamplingParams

FinishType = Literal["stop", "length", "abort"]
FINISH_TYPES: tuple[FinishType, ...] = ("stop", "length", "abort")


@dataclass(frozen=True)
class FinishReason:
    """``stop`` (an EOS/stop token id or stop string, in ``matched``), ``length`` (the token
    limit or the context, ``length`` tokens generated) or ``abort`` (``message`` says why)."""

    type: FinishType
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    @staticmethod
    def stop(matched: int | str) -> FinishReason:
        return FinishReason("stop", matched=matched)

    @staticmethod
    def at_length(length: int) -> FinishReason:
        return FinishReason("length", length=length)

    @staticmethod
    def abort(message: str) -> FinishReason:
        return FinishReason("abort", message=message)

    def to_json(self) -> dict:
        out: dict = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message
        return out


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None
    slots: list[int] = field(default_factory=list)  # KV slots of the tokens in the cache
    num_prefilled: int = 0
    finish_reason: FinishReason | None = None
    prefill_records: list[GraphRecord] = field(default_factory=list)
    decode_graph_steps: int = 0  # decode steps of this request that replayed a graph
    decode_eager_steps: int = 0  # ... and that ran eagerly
    # what its prefill computes: the prompt, or after a retraction the prompt and the tokens
    # generated so far (its KV was given up; it resumes by recomputing it)
    prefill_ids: list[int] = field(default_factory=list)
    retractions: int = 0
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1..

    def __post_init__(self) -> None:
        if not self.prefill_ids:
            self.prefill_ids = list(self.prompt_ids)

    created_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_cached(self) -> int:
        return len(self.slots)

    @property
    def prefilled(self) -> bool:
        return self.num_prefilled >= len(self.prefill_ids)

    def remaining_tokens(self, context_length: int) -> int:
        """Tokens it may still generate: its limit, or the room left in its context."""
        left = self.sampling.max_new_tokens - len(self.output_ids)
        return max(0, min(left, context_length - len(self.prompt_ids) - len(self.output_ids)))
