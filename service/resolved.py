"""Values resolved at start-up, built once by the coordinator; `/server_info` reports them."""

from __future__ import annotations

from dataclasses import dataclass

from service.buckets import BucketPlan
from service.capture_result import CaptureStat
from service.config import EngineConfig
from service.decode_sizes import DecodePlan
from service.rank_info import RankInfo


@dataclass(frozen=True)
class RankCapture:
    rank: int
    stats: tuple[CaptureStat, ...]  # one per captured bucket, in capture order

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stats)

    @property
    def memory_bytes(self) -> int:
        return sum(s.memory_bytes for s in self.stats)

    def to_json(self, what: str) -> dict:
        return {
            "rank": self.rank,
            "seconds": round(self.seconds, 4),
            "memory_bytes": self.memory_bytes,
            what: [s.to_json() for s in self.stats],
        }


@dataclass(frozen=True)
class ResolvedConfig:
    config: EngineConfig
    executor: str  # "local" or "ray"
    tp: int
    limits: RankInfo  # the values every rank honours (service.rank_info.agree_rank_infos)
    plan: BucketPlan  # the agreed plan, capture failures dropped: what prefill replays
    graph_kind: str | None  # "cuda" | "cpu" | None (eager)
    captures: tuple[RankCapture, ...]
    decode: DecodePlan  # the agreed decode sizes, capture failures dropped
    decode_graph_kind: str | None
    decode_captures: tuple[RankCapture, ...]

    # the names the rest of the system reads, so that no caller reaches through `limits`
    @property
    def model_dir(self) -> str:
        return self.limits.model_dir

    @property
    def context_length(self) -> int:
        return self.limits.context_length

    @property
    def max_running_requests(self) -> int:
        return self.limits.max_running_requests

    @property
    def num_kv_slots(self) -> int:
        return self.limits.num_kv_slots

    @property
    def chunked_prefill_size(self) -> int:
        return self.limits.chunked_prefill_size

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.limits.eos_token_ids

    def to_json(self) -> dict:
        plan = self.plan.to_json()
        limits = self.limits.to_json()
        model, attention = limits.pop("model_dir"), limits.pop("attention")
        kernels, gate_up = limits.pop("kernels"), limits.pop("gate_up")
        rope_store, splitk_norm = limits.pop("rope_store"), limits.pop("splitk_norm")
        schedule = limits.pop("prefill_schedule")
        return {
            "model": model,
            **limits,
            "attention_backend": attention,
            "fused_kernels": kernels,
            "gate_up_kernel": gate_up,
            "rope_store_kernel": rope_store,
            "splitk_norm_kernel": splitk_norm,
            "prefill_schedule": schedule,
            "tp": self.tp,
            "executor": self.executor,
            "prefill_backend": self.plan.backend,
            "capture_request_capacity": self.plan.capture_request_capacity,
            "max_capture_tokens": plan["max_capture_tokens"],
            "graph_kind": self.graph_kind,
            "buckets": plan["buckets"],
            "dropped_buckets": plan["dropped"],
            "disabled_reason": plan["disabled_reason"],
            "capture": [c.to_json("buckets") for c in self.captures],
            "decode_graphs": {
                **self.decode.to_json(),
                "graph_kind": self.decode_graph_kind,
                "capture": [c.to_json("sizes") for c in self.decode_captures],
            },
        }
