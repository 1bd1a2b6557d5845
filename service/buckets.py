"""The prefill bucket rules: which buckets are legal, how each is captured, what a batch replays.

Pure policy, no torch import. Every runner, the coordinator, the scheduler and the `plan` command
call these functions; nothing else decides about buckets.

Vocabulary (see shared/DESIGN.md):

- A *bucket* is an aggregate token count: all requests of one prefill batch together.
- The *capture request capacity* C is how many requests one captured batch may hold: the
  request-pool size (``max_running_requests``, resolved) for ``breakable`` and ``tc_piecewise``,
  and the fixed request-slot count S for ``full``.
- A bucket b is *legal* iff ``b <= context_length * C`` and ``b <= max_prefill_tokens``.
- A legal bucket is captured as ``k = ceil(b / context_length)`` synthetic requests, each of
  ``1 <= seq_len <= context_length``, summing to b. ``full`` pads the request axis with
  zero-length sentinel slots up to exactly S.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

from service.errors import PlanError

PrefillBackend = Literal["full", "breakable", "tc_piecewise", "eager"]
PREFILL_BACKENDS: tuple[str, ...] = get_args(PrefillBackend)
GRAPH_BACKENDS: tuple[str, ...] = ("full", "breakable", "tc_piecewise")

# Miss reasons, as reported in meta_info and as the `reason` label of the Prometheus counter.
MISS_DISABLED = "disabled"
MISS_TOO_MANY_TOKENS = "too_many_tokens"
MISS_TOO_MANY_REQUESTS = "too_many_requests"
MISS_PADDING_OVER_LIMIT = "padding_over_limit"
MISS_REASONS: tuple[str, ...] = (
    MISS_DISABLED,
    MISS_TOO_MANY_TOKENS,
    MISS_TOO_MANY_REQUESTS,
    MISS_PADDING_OVER_LIMIT,
)

# The default `full` request-slot count when the user sets none: enough slots for typical
# multi-request prefills, bounded so that the static attention metadata stays small.
DEFAULT_FULL_REQUEST_SLOTS = 8


def default_prefill_buckets(max_prefill_tokens: int) -> tuple[int, ...]:
    """The default bucket list in aggregate tokens, ascending, ending at ``max_prefill_tokens``.

    Two buckets per power of two (16, 24, 32, 48, 64, 96, ...): padding never exceeds a third of
    a bucket above 16 tokens, the list stays short (18 buckets up to 8192, which keeps capture
    time and graph memory small), and dense where graphs pay most (small batches are
    launch-bound). ``max_prefill_tokens`` itself is always the last bucket so that a full chunk of
    chunked prefill has a graph.
    """
    _require_positive("max_prefill_tokens", max_prefill_tokens)
    sizes: list[int] = []
    base = 16
    while base <= max_prefill_tokens:
        for size in (base, base * 3 // 2):
            if size < max_prefill_tokens:
                sizes.append(size)
        base *= 2
    sizes.append(max_prefill_tokens)
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class ResolvedRequestPool:
    """The request-pool size once it is known (derived from KV capacity when the user set none).

    The planner only accepts this type, so an unresolved ``None`` can never reach a computation.
    """

    max_running_requests: int

    def __post_init__(self) -> None:
        if self.max_running_requests is None:
            raise PlanError(
                "max_running_requests is unresolved (None); resolve the request pool from the KV "
                "cache capacity before planning buckets"
            )
        if isinstance(self.max_running_requests, bool) or not isinstance(
            self.max_running_requests, int
        ):
            raise PlanError(
                f"max_running_requests must be an int, got {self.max_running_requests!r}"
            )
        _require_positive("max_running_requests", self.max_running_requests)


@dataclass(frozen=True)
class CaptureBucket:
    """A bucket that will be captured, with the synthetic request lengths of its capture batch."""

    num_tokens: int
    capture_seq_lens: tuple[int, ...]

    @property
    def num_synthetic_requests(self) -> int:
        """Requests with tokens (sentinel slots excluded)."""
        return sum(1 for n in self.capture_seq_lens if n > 0)


@dataclass(frozen=True)
class DroppedBucket:
    num_tokens: int
    reason: str


@dataclass(frozen=True)
class BucketPlan:
    """The resolved capture plan of one rank (or the agreed plan of all ranks)."""

    backend: PrefillBackend
    context_length: int
    capture_request_capacity: int
    max_prefill_tokens: int
    buckets: tuple[CaptureBucket, ...]
    dropped: tuple[DroppedBucket, ...] = ()
    disabled_reason: str | None = None
    max_padding_fraction: float = 1.0

    def __post_init__(self) -> None:
        sizes = self.bucket_sizes
        if list(sizes) != sorted(set(sizes)):
            raise PlanError(f"plan buckets must be strictly ascending, got {list(sizes)}")

    @property
    def enabled(self) -> bool:
        return bool(self.buckets)

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        return tuple(b.num_tokens for b in self.buckets)

    @property
    def max_capture_tokens(self) -> int:
        """The legal cap: ``min(context_length * C, max_prefill_tokens)``; 0 for eager."""
        if self.backend == "eager":
            return 0
        return min(self.context_length * self.capture_request_capacity, self.max_prefill_tokens)

    def bucket(self, num_tokens: int) -> CaptureBucket:
        sizes = self.bucket_sizes
        i = bisect.bisect_left(sizes, num_tokens)
        if i == len(sizes) or sizes[i] != num_tokens:
            raise KeyError(f"bucket {num_tokens} is not in the plan {list(sizes)}")
        return self.buckets[i]

    def to_json(self) -> dict:
        return {
            "backend": self.backend,
            "context_length": self.context_length,
            "capture_request_capacity": self.capture_request_capacity,
            "max_capture_tokens": self.max_capture_tokens,
            "buckets": [
                {"num_tokens": b.num_tokens, "capture_seq_lens": list(b.capture_seq_lens)}
                for b in self.buckets
            ],
            "dropped": [{"num_tokens": d.num_tokens, "reason": d.reason} for d in self.dropped],
            "disabled_reason": self.disabled_reason,
        }


def capture_request_capacity(
    backend: PrefillBackend, pool: ResolvedRequestPool, full_request_slots: int | None
) -> int:
    """C for a backend: the pool size, or the fixed slot count S for ``full``."""
    if backend == "full":
        return resolve_full_request_slots(pool, full_request_slots)
    return pool.max_running_requests


def resolve_full_request_slots(pool: ResolvedRequestPool, full_request_slots: int | None) -> int:
    """S: the user's value, else ``min(DEFAULT_FULL_REQUEST_SLOTS, pool size)``.

    A user value above the pool size is an error: a slot the pool cannot back can never be used.
    """
    if full_request_slots is None:
        return min(DEFAULT_FULL_REQUEST_SLOTS, pool.max_running_requests)
    _require_positive("full_request_slots", full_request_slots)
    if full_request_slots > pool.max_running_requests:
        raise PlanError(
            f"full_request_slots {full_request_slots} exceeds max_running_requests "
            f"{pool.max_running_requests}; lower --full-request-slots or raise "
            "--max-running-requests"
        )
    return full_request_slots


def partition_bucket(num_tokens: int, context_length: int) -> tuple[int, ...]:
    """Split a bucket into the fewest synthetic requests with ``seq_len <= context_length``.

    Requests are filled to ``context_length`` and the remainder goes last: capture then exercises
    the widest legal per-request row (the case that overflowed in the naive one-request capture),
    and the count ``ceil(num_tokens / context_length)`` is the minimum.
    """
    _require_positive("num_tokens", num_tokens)
    _require_positive("context_length", context_length)
    full, rest = divmod(num_tokens, context_length)
    return (context_length,) * full + ((rest,) if rest else ())


def resolve_plan(
    *,
    backend: PrefillBackend,
    context_length: int,
    pool: ResolvedRequestPool,
    max_prefill_tokens: int,
    buckets: Sequence[int] | None = None,
    full_request_slots: int | None = None,
    max_padding_fraction: float = 1.0,
) -> BucketPlan:
    """Resolve the legal bucket set of one rank. Never raises for an empty result.

    ``buckets=None`` takes :func:`default_prefill_buckets`. Duplicates are merged; order does not
    matter. Returns the surviving buckets ascending (capture goes largest first), every dropped
    bucket with its reason, and ``disabled_reason`` when nothing survives.
    """
    if backend not in PREFILL_BACKENDS:
        raise PlanError(
            f"unsupported prefill backend {backend!r}; supported: {list(PREFILL_BACKENDS)}"
        )
    if not isinstance(pool, ResolvedRequestPool):
        raise PlanError(
            "resolve_plan needs a ResolvedRequestPool (the request pool sized at start-up), "
            f"got {pool!r}"
        )
    _require_positive("context_length", context_length)
    _require_positive("max_prefill_tokens", max_prefill_tokens)
    if not 0.0 <= max_padding_fraction <= 1.0:
        raise PlanError(f"max_padding_fraction must be within [0, 1], got {max_padding_fraction}")
    requested = (
        sorted(set(parse_bucket_values(buckets)))
        if buckets is not None
        else list(default_prefill_buckets(max_prefill_tokens))
    )
    capacity = capture_request_capacity(backend, pool, full_request_slots)
    common = dict(
        backend=backend,
        context_length=context_length,
        capture_request_capacity=capacity,
        max_prefill_tokens=max_prefill_tokens,
        max_padding_fraction=max_padding_fraction,
    )
    if backend == "eager":
        return BucketPlan(
            buckets=(),
            disabled_reason="prefill backend 'eager' captures no graphs",
            **common,
        )

    kept: list[CaptureBucket] = []
    dropped: list[DroppedBucket] = []
    legal_cap = context_length * capacity
    capacity_name = "request slots (full)" if backend == "full" else "request pool size"
    for size in requested:
        if size > max_prefill_tokens:
            dropped.append(
                DroppedBucket(
                    size,
                    f"bucket {size} exceeds max prefill tokens per batch {max_prefill_tokens}; "
                    "raise --chunked-prefill-size or lower the bucket",
                )
            )
        elif size > legal_cap:
            raise_hint = (
                "raise --full-request-slots"
                if backend == "full"
                else "raise --max-running-requests"
            )
            dropped.append(
                DroppedBucket(
                    size,
                    f"bucket {size} exceeds context_length {context_length} x {capacity} "
                    f"{capacity_name} = {legal_cap}; {raise_hint} or lower the bucket",
                )
            )
        else:
            lens = partition_bucket(size, context_length)
            if backend == "full":
                lens = lens + (0,) * (capacity - len(lens))
            kept.append(CaptureBucket(size, lens))

    disabled_reason = None
    if not kept:
        disabled_reason = _disabled(
            "no legal prefill bucket", backend, context_length, capacity,
            f" ({capacity_name}); requested {requested}",
        )  # fmt: skip
    return BucketPlan(
        buckets=tuple(kept), dropped=tuple(dropped), disabled_reason=disabled_reason, **common
    )


def agree_plans(plans: Sequence[BucketPlan]) -> BucketPlan:
    """The one plan every rank captures: the intersection of the ranks' legal bucket sets.

    Ranks must agree on backend and context length; capture lengths come from rank 0 (they
    depend only on the bucket, the context length and the smallest capacity, which is used).
    """
    if not plans:
        raise PlanError("agree_plans needs at least one rank's plan")
    first = plans[0]
    for rank, plan in enumerate(plans):
        if (plan.backend, plan.context_length) != (first.backend, first.context_length):
            raise PlanError(
                f"rank {rank} resolved backend {plan.backend} / context_length "
                f"{plan.context_length}, rank 0 {first.backend} / {first.context_length}; "
                "every rank must run the same configuration"
            )
    common = set(first.bucket_sizes)
    for plan in plans[1:]:
        common &= set(plan.bucket_sizes)
    narrowest = min(plans, key=lambda p: p.capture_request_capacity)
    dropped: dict[int, DroppedBucket] = {}
    for rank, plan in enumerate(plans):
        for d in plan.dropped:
            if d.num_tokens in dropped:
                continue
            everywhere = all(d.num_tokens not in p.bucket_sizes for p in plans)
            reason = (
                d.reason
                if everywhere or len(plans) == 1
                else (f"not legal on every rank (rank {rank}: {d.reason})")
            )
            dropped[d.num_tokens] = DroppedBucket(d.num_tokens, reason)
    kept = tuple(b for b in narrowest.buckets if b.num_tokens in common)
    disabled = first.disabled_reason if first.backend == "eager" else None
    if first.backend != "eager" and not kept:
        disabled = _disabled(
            "no prefill bucket is legal on every rank", first.backend, first.context_length,
            narrowest.capture_request_capacity,
        )  # fmt: skip
    return BucketPlan(
        backend=first.backend,
        context_length=first.context_length,
        capture_request_capacity=narrowest.capture_request_capacity,
        max_prefill_tokens=min(p.max_prefill_tokens for p in plans),
        buckets=kept,
        dropped=tuple(sorted(dropped.values(), key=lambda d: d.num_tokens)),
        disabled_reason=disabled,
        max_padding_fraction=first.max_padding_fraction,
    )


def drop_buckets(plan: BucketPlan, failures: dict[int, str]) -> BucketPlan:
    """The plan without buckets whose capture failed (on any rank), each with its reason."""
    if not failures:
        return plan
    kept = tuple(b for b in plan.buckets if b.num_tokens not in failures)
    dropped = plan.dropped + tuple(
        DroppedBucket(size, f"capture failed: {reason}")
        for size, reason in sorted(failures.items())
    )
    disabled = plan.disabled_reason
    if not kept and disabled is None:
        disabled = _disabled(
            "every prefill bucket failed to capture", plan.backend, plan.context_length,
            plan.capture_request_capacity,
        )  # fmt: skip
    return replace(
        plan,
        buckets=kept,
        dropped=tuple(sorted(dropped, key=lambda d: d.num_tokens)),
        disabled_reason=disabled,
    )


@dataclass(frozen=True)
class ReplayDecision:
    """Whether a real prefill batch replays a captured bucket, and if not, why."""

    hit: bool
    bucket: int | None
    padded_tokens: int
    miss_reason: str | None

    @staticmethod
    def miss(reason: str) -> ReplayDecision:
        return ReplayDecision(hit=False, bucket=None, padded_tokens=0, miss_reason=reason)


def decide_replay(plan: BucketPlan, num_tokens: int, num_requests: int) -> ReplayDecision:
    """Hit (the smallest captured bucket >= num_tokens) or miss with a reason."""
    _require_positive("num_tokens", num_tokens)
    _require_positive("num_requests", num_requests)
    if num_requests > num_tokens:
        raise PlanError(
            f"a prefill batch of {num_requests} requests needs at least as many tokens, "
            f"got {num_tokens}"
        )
    if not plan.enabled:
        return ReplayDecision.miss(MISS_DISABLED)
    if num_requests > plan.capture_request_capacity:
        return ReplayDecision.miss(MISS_TOO_MANY_REQUESTS)
    sizes = plan.bucket_sizes
    i = bisect.bisect_left(sizes, num_tokens)
    if i == len(sizes):
        return ReplayDecision.miss(MISS_TOO_MANY_TOKENS)
    bucket = sizes[i]
    padded = bucket - num_tokens
    if padded > plan.max_padding_fraction * bucket:
        return ReplayDecision.miss(MISS_PADDING_OVER_LIMIT)
    return ReplayDecision(hit=True, bucket=bucket, padded_tokens=padded, miss_reason=None)


def parse_bucket_values(values: Iterable[int | str] | str) -> list[int]:
    """Bucket sizes from a list or a comma-separated string, each a positive int."""
    return parse_sizes(values, "bucket", "token count", "4096,8192")


def parse_sizes(values: Iterable[int | str] | str, noun: str, unit: str, example: str) -> list[int]:
    """Positive ints from a list or a comma-separated string; errors name the ``noun`` (a bucket,
    a decode size) and show an ``example`` of a good list."""
    items = values.split(",") if isinstance(values, str) else list(values)
    out: list[int] = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        try:
            size = int(text)
        except ValueError:
            raise PlanError(
                f"{noun} {text!r} is not an integer; give {unit}s like {example}"
            ) from None
        if size <= 0:
            raise PlanError(f"{noun} {size} must be a positive {unit}")
        out.append(size)
    if not out:
        raise PlanError(f"the {noun} list is empty; give {unit}s like {example}")
    return out


def _disabled(what: str, backend: str, context_length: int, capacity: int, extra: str = "") -> str:
    """The one warning of invariant 4: it names backend, context length and request capacity."""
    return (
        f"{what} for backend {backend} with context_length {context_length} and capture "
        f"request capacity {capacity}{extra}; prefill runs eagerly"
    )


def _require_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise PlanError(f"{name} must be positive, got {value}")
