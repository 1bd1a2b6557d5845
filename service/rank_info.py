"""What a rank resolved at start-up, and which attention kernels it runs (typed, picklable).

No torch import: these travel from the ranks to the coordinator, which agrees across ranks
(:func:`agree_rank_infos`) and keeps the result in the resolved configuration.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from service.errors import ConfigError


@dataclass(frozen=True)
class BackendChoice:
    name: str  # "flashinfer" | "torch"
    reason: str  # one line: why this backend

    def to_json(self) -> dict:
        return {"name": self.name, "reason": self.reason}


@dataclass(frozen=True)
class RankInfo:
    """One rank's start-up values; the coordinator agrees across ranks from these."""

    rank: int
    device: str
    dtype: str
    context_length: int
    max_running_requests: int
    num_kv_slots: int
    chunked_prefill_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    model_dir: str
    architecture: str
    attention: BackendChoice
    kernels: BackendChoice  # the model's fused elementwise kernels
    gate_up: BackendChoice  # the MLP's gate_up GEMM + SiLU-and-mul: "triton" or "torch"
    # rotary + K/V store: "triton" (one kernel) or "torch" (FlashInfer's or torch's rotary, then
    # the store)
    rope_store: BackendChoice
    # o_proj / down + add-RMSNorm: "triton" (split over K, summed by the norm) or "torch"
    splitk_norm: BackendChoice
    # which SM runs which prefill attention work item: "balanced" (FA3's items dealt longest
    # first) or "own" (the kernel's schedule)
    prefill_schedule: BackendChoice

    def to_json(self) -> dict:
        out = asdict(self)
        del out["rank"]
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out


# the start-up choices every rank must share: (RankInfo field, what it is, the flag that fixes it)
SHARED_CHOICES = (
    ("attention", "attention backends", "--attention-backend"),
    ("kernels", "fused kernels", "--fused-kernels"),
    ("gate_up", "gate_up kernels", "--gate-up-kernel"),
    ("rope_store", "rope_store kernels", "--rope-store-kernel"),
    ("splitk_norm", "splitk_norm kernels", "--splitk-norm-kernel"),
    ("prefill_schedule", "prefill schedules", "--prefill-schedule"),
)


def agree_rank_infos(infos: list[RankInfo]) -> RankInfo:
    """The values every rank can honour: the smallest pool, KV and chunk sizes, and rank 0's
    model and kernels (which every rank must share)."""
    if not infos:
        raise ConfigError("no rank reported its start-up values")
    first = infos[0]
    # ranks of one model must run the same kernels (the same numerics on every shard)
    for attr, what, flag in SHARED_CHOICES:
        if len({getattr(i, attr).name for i in infos}) > 1:
            raise ConfigError(
                f"ranks chose different {what}: "
                + ", ".join(
                    f"rank {i.rank}: {getattr(i, attr).name} ({getattr(i, attr).reason})"
                    for i in infos
                )
                + f"; pass {flag} explicitly"
            )
    return replace(
        first,
        max_running_requests=min(i.max_running_requests for i in infos),
        num_kv_slots=min(i.num_kv_slots for i in infos),
        chunked_prefill_size=min(i.chunked_prefill_size for i in infos),
    )
