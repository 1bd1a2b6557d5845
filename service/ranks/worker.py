"""What one tensor-parallel rank runs at run time: plan, capture, execute.

The body of a Ray actor at tp>1 and an in-process object at tp=1, built from the
:class:`~service.ranks.startup.RankSetup` of start-up. It decides nothing that must agree across
ranks: rows, slots and graph decisions arrive in each :class:`ForwardCommand`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from service.buckets import MISS_DISABLED, BucketPlan, ReplayDecision, ResolvedRequestPool
from service.capture_result import CaptureFailure, CaptureResult
from service.commands import ForwardCommand, ForwardResult, GraphKind, GraphRecord
from service.errors import RankFailure
from service.rank_info import RankInfo
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.ranks.runners.base import PrefillRunner
from service.ranks.runners.eager import EagerRunner
from service.ranks.runners.registry import make_runner
from service.ranks.sampler import sample
from service.ranks.startup import RankSetup

log = logging.getLogger(__name__)


# what torch.distributed's backends say when a collective times out or a peer went away
_COLLECTIVE_ERRORS = ("gloo", "NCCL", "Timed out waiting", "Connection closed by peer")


def is_collective_error(exc: BaseException) -> bool:
    return isinstance(exc, torch.distributed.DistError) or any(
        s in str(exc) for s in _COLLECTIVE_ERRORS
    )


def capture_failure(
    exc: BaseException,
    rank: int,
    num_tokens: int,
    check_device: Callable[[], None],
    world_size: int = 1,
) -> CaptureFailure:
    """A failed capture drops its bucket, whatever it raised, unless it left the device unusable.

    ``check_device`` synchronizes the device: if that fails too (an illegal memory access or a
    device-side assert poisons the CUDA context for good), this rank cannot run anything any
    more, and the capture's own message, the first one, is what the operator needs to read.
    A collective that failed inside the capture (a peer failed before reaching it) marks the
    failure ``desync``: the coordinator then fails start-up instead of dropping the bucket.
    """
    try:
        check_device()
    except Exception as poisoned:
        raise RankFailure(
            f"rank {rank}: the device is unusable after capturing bucket {num_tokens}: "
            f"{type(exc).__name__}: {exc}"
        ) from poisoned
    return CaptureFailure(
        num_tokens,
        rank,
        type(exc).__name__,
        str(exc).splitlines()[0][:500],
        desync=world_size > 1 and is_collective_error(exc),
    )


class RankWorker:
    def __init__(self, setup: RankSetup) -> None:
        self.setup = setup
        self.model = setup.model
        self.device = setup.device
        self.req_to_token = setup.req_to_token
        self.kv = setup.kv
        self.eager_runner = EagerRunner(self.model, setup.eager_attention)
        self.runner: PrefillRunner = self.eager_runner

    @property
    def info(self) -> RankInfo:
        return self.setup.info

    @property
    def rank(self) -> int:
        return self.setup.tp.rank

    # ---- start-up: buckets -----------------------------------------------------------------
    def resolve_local_plan(self) -> BucketPlan:
        """This rank's legal bucket set, from its own resolved request pool."""
        return self.setup.cfg.graph.plan(
            context_length=self.info.context_length,
            pool=ResolvedRequestPool(self.info.max_running_requests),
            max_prefill_tokens=self.info.chunked_prefill_size,
        )

    def build_runner(self, plan: BucketPlan) -> None:
        """Build the graph runner for an agreed, non-empty plan (nothing for an empty one)."""
        if not plan.enabled:
            self.runner = self.eager_runner
            return
        s = self.setup
        self.runner = make_runner(plan, s.model, s.eager_attention, s.graph_attention, s.device)

    @torch.inference_mode()
    def capture_bucket(self, plan: BucketPlan, num_tokens: int) -> CaptureResult:
        """Capture one bucket; any failure comes back as a :class:`CaptureFailure` (the
        coordinator drops the bucket on every rank), or as :class:`RankFailure` when the device
        is unusable afterwards."""
        try:
            return self.runner.capture_bucket(plan, num_tokens)
        except Exception as exc:
            log.warning("Capture of bucket %d failed: %s: %s", num_tokens, type(exc).__name__, exc)
            return capture_failure(
                exc, self.rank, num_tokens, self._check_device, self.setup.tp.world_size
            )

    def _check_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def forget_bucket(self, num_tokens: int) -> None:
        self.runner.forget(num_tokens)

    # ---- run time ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, cmd: ForwardCommand) -> ForwardResult:
        for w in cmd.row_writes:
            self.req_to_token.write(w.row, w.start, list(w.slots))
        layout = BatchLayout(
            mode=ForwardMode.EXTEND if cmd.is_prefill else ForwardMode.DECODE,
            req_pool_indices=cmd.req_pool_indices,
            prefix_lens=cmd.prefix_lens,
            extend_lens=cmd.extend_lens,
        )
        batch = ForwardBatch.build(
            layout, list(cmd.input_ids), list(cmd.out_cache_loc), self.device
        )
        record = None
        if cmd.is_prefill:
            decision = cmd.decision or ReplayDecision.miss(MISS_DISABLED)
            if decision.hit and not self.runner.can_replay(decision):
                raise RankFailure(
                    f"rank {self.rank} was told to replay bucket {decision.bucket}, which it "
                    f"has not captured ({list(self.runner.captured_buckets())})"
                )
            runner = self.runner if decision.hit else self.eager_runner
            hidden = runner.run(batch, decision)
            record = GraphRecord.from_decision(
                decision, layout.num_tokens, layout.num_requests, self.graph_kind or "cpu"
            )
        else:
            hidden = self.eager_runner.run(batch, ReplayDecision.miss(MISS_DISABLED))
        last = hidden.index_select(0, batch.last_token_indices())
        logits = self.model.logits(last)  # (B, V)
        next_ids = sample(logits, list(cmd.sampling), list(cmd.steps))
        return ForwardResult(
            next_token_ids=tuple(next_ids),
            record=record,
            logits=logits.cpu() if cmd.return_logits else None,
        )

    @property
    def graph_kind(self) -> GraphKind | None:
        return self.runner.graph_kind

    def kv_snapshot(self) -> list[torch.Tensor]:
        """A copy of every layer's K pool (tests check that padding never writes live slots)."""
        return [k.clone().cpu() for k in self.kv.k]
