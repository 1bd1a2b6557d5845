"""The decode graph rules: which decode batch sizes are captured, and what a decode step replays.

Pure policy, no torch import, the decode twin of :mod:`service.buckets`. A decode step runs one
new token for each of its B running requests; a captured *size* S serves every step with
B <= S, padded with S - B slots whose K/V write the padding slot (service.padding) and whose
sampled tokens are dropped.

- Default sizes: dense where decode is launch-bound and batches are common (1, 2, 4, 8, 12, 16,
  24, 32), then every 16 up to 128, every 32 up to 256, every 64 beyond, always ending at the
  resolved request-pool size so that a full pool has a graph.
- A size is legal iff ``1 <= size <= max_running_requests`` (a decode batch never holds more
  requests than the pool).
- A step replays the smallest captured size >= B, or misses with a reason: ``disabled`` (decode
  graphs off, or none captured) or ``too_many_requests`` (B above the largest size).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from service.buckets import MISS_DISABLED, MISS_TOO_MANY_REQUESTS, parse_sizes
from service.errors import PlanError

DECODE_MISS_REASONS: tuple[str, ...] = (MISS_DISABLED, MISS_TOO_MANY_REQUESTS)
DENSE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32)


def default_decode_sizes(max_running_requests: int) -> tuple[int, ...]:
    """The default list, ascending, ending at ``max_running_requests``."""
    _require_positive("max_running_requests", max_running_requests)
    sizes: list[int] = list(DENSE_SIZES)
    n = DENSE_SIZES[-1]
    while n < max_running_requests:
        n += 16 if n < 128 else 32 if n < 256 else 64
        sizes.append(n)
    kept = [s for s in sizes if s < max_running_requests]
    return (*kept, max_running_requests)


@dataclass(frozen=True)
class DroppedSize:
    size: int
    reason: str


@dataclass(frozen=True)
class DecodePlan:
    """The decode sizes a rank captures (or the agreed sizes of all ranks)."""

    sizes: tuple[int, ...]
    max_running_requests: int
    dropped: tuple[DroppedSize, ...] = ()
    disabled_reason: str | None = None

    def __post_init__(self) -> None:
        if list(self.sizes) != sorted(set(self.sizes)):
            raise PlanError(f"decode sizes must be strictly ascending, got {list(self.sizes)}")

    @property
    def enabled(self) -> bool:
        return bool(self.sizes)

    def to_json(self) -> dict:
        return {
            "sizes": list(self.sizes),
            "dropped": [{"size": d.size, "reason": d.reason} for d in self.dropped],
            "disabled_reason": self.disabled_reason,
        }


def resolve_decode_plan(
    *, enabled: bool, max_running_requests: int, sizes: Sequence[int] | None = None
) -> DecodePlan:
    """One rank's decode sizes: the user's (or the default list), within the request pool."""
    _require_positive("max_running_requests", max_running_requests)
    if not enabled:
        return DecodePlan((), max_running_requests, disabled_reason="decode graphs are off")
    wanted = (
        sorted(set(parse_decode_sizes(sizes)))
        if sizes is not None
        else list(default_decode_sizes(max_running_requests))
    )
    kept = tuple(s for s in wanted if s <= max_running_requests)
    dropped = tuple(
        DroppedSize(
            s,
            f"decode size {s} exceeds max_running_requests {max_running_requests}; raise "
            "--max-running-requests or lower the size",
        )
        for s in wanted
        if s > max_running_requests
    )
    disabled = None if kept else "no decode size fits the request pool; decode runs eagerly"
    return DecodePlan(kept, max_running_requests, dropped, disabled)


def agree_decode_plans(plans: Sequence[DecodePlan]) -> DecodePlan:
    """The sizes every rank captures: the intersection of the ranks' sizes."""
    if not plans:
        raise PlanError("agree_decode_plans needs at least one rank's plan")
    common = set(plans[0].sizes)
    for plan in plans[1:]:
        common &= set(plan.sizes)
    dropped: dict[int, DroppedSize] = {}
    for rank, plan in enumerate(plans):
        for d in plan.dropped:
            dropped.setdefault(d.size, d)
        for s in plan.sizes:
            if s not in common:
                dropped.setdefault(s, DroppedSize(s, f"not legal on every rank (rank {rank})"))
    kept = tuple(sorted(common))
    disabled = plans[0].disabled_reason
    if disabled is None and not kept:
        disabled = "no decode size is legal on every rank; decode runs eagerly"
    return DecodePlan(
        kept,
        min(p.max_running_requests for p in plans),
        tuple(sorted(dropped.values(), key=lambda d: d.size)),
        disabled,
    )


def drop_decode_sizes(plan: DecodePlan, failures: dict[int, str]) -> DecodePlan:
    """The plan without sizes whose capture failed (on any rank), each with its reason."""
    if not failures:
        return plan
    kept = tuple(s for s in plan.sizes if s not in failures)
    dropped = plan.dropped + tuple(
        DroppedSize(s, f"capture failed: {reason}") for s, reason in sorted(failures.items())
    )
    disabled = plan.disabled_reason
    if not kept and disabled is None:
        disabled = "every decode size failed to capture; decode runs eagerly"
    return replace(
        plan, sizes=kept, dropped=tuple(sorted(dropped, key=lambda d: d.size)),
        disabled_reason=disabled,
    )  # fmt: skip


@dataclass(frozen=True)
class DecodeDecision:
    """Whether a decode step replays a captured size, and if not, why."""

    hit: bool
    size: int | None
    padded: int
    miss_reason: str | None


def decide_decode(plan: DecodePlan, batch_size: int) -> DecodeDecision:
    """Hit (the smallest captured size >= batch_size) or miss with a reason."""
    _require_positive("batch_size", batch_size)
    if not plan.enabled:
        return DecodeDecision(False, None, 0, MISS_DISABLED)
    i = bisect.bisect_left(plan.sizes, batch_size)
    if i == len(plan.sizes):
        return DecodeDecision(False, None, 0, MISS_TOO_MANY_REQUESTS)
    size = plan.sizes[i]
    return DecodeDecision(True, size, size - batch_size, None)


def parse_decode_sizes(values: Iterable[int | str] | str) -> list[int]:
    """Decode sizes from a list or a comma-separated string, each a positive int."""
    return parse_sizes(values, "decode size", "batch size", "1,2,4,8")


def _require_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{name} must be a positive int, got {value!r}")
