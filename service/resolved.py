"""Values resolved at start-up, built once by the coordinator; `/server_info` reports them."""

from __future__ import annotations

from dataclasses import dataclass

from service.buckets import BucketPlan
from service.config import EngineConfig


@dataclass(frozen=True)
class RankCapture:
    rank: int
    stats: tuple[dict, ...]  # CaptureStat.to_json() per bucket

    @property
    def seconds(self) -> float:
        return sum(s["seconds"] for s in self.stats)

    @property
    def memory_bytes(self) -> int:
        return sum(s["memory_bytes"] for s in self.stats)


@dataclass(frozen=True)
class ResolvedConfig:
    config: EngineConfig
    model_dir: str
    architecture: str
    device: str
    dtype: str
    tp: int
    executor: str  # "local" or "ray"
    context_length: int
    max_running_requests: int
    num_kv_slots: int
    chunked_prefill_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    attention: dict  # AttentionChoice.to_json(): the kernels every rank runs, and why
    plan: BucketPlan  # the agreed plan, capture failures dropped: what prefill replays
    graph_kind: str | None  # "cuda" | "cpu" | None (eager)
    captures: tuple[RankCapture, ...]

    def to_json(self) -> dict:
        plan = self.plan.to_json()
        return {
            "model": self.model_dir,
            "architecture": self.architecture,
            "device": self.device,
            "dtype": self.dtype,
            "tp": self.tp,
            "executor": self.executor,
            "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            "num_kv_slots": self.num_kv_slots,
            "chunked_prefill_size": self.chunked_prefill_size,
            "attention_backend": self.attention,
            "prefill_backend": self.plan.backend,
            "capture_request_capacity": self.plan.capture_request_capacity,
            "max_capture_tokens": plan["max_capture_tokens"],
            "graph_kind": self.graph_kind,
            "buckets": plan["buckets"],
            "dropped_buckets": plan["dropped"],
            "disabled_reason": plan["disabled_reason"],
            "capture": [
                {
                    "rank": c.rank,
                    "seconds": round(c.seconds, 4),
                    "memory_bytes": c.memory_bytes,
                    "buckets": list(c.stats),
                }
                for c in self.captures
            ],
        }
