"""What one tensor-parallel rank runs at run time: plan, capture, execute.

The body of a Ray actor at tp>1 and an in-process object at tp=1, built from the
:class:`~service.ranks.startup.RankSetup` of start-up. It decides nothing that must agree across
ranks: rows, slots and graph decisions arrive in each :class:`ForwardCommand`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from service.buckets import MISS_DISABLED, BucketPlan, ReplayDecision, ResolvedRequestPool
from service.capture_result import CaptureFailure, CaptureResult, GraphSet, RankPlans
from service.commands import (
    DecodeRecord,
    ForwardCommand,
    ForwardResult,
    GraphKind,
    GraphRecord,
    TokenLogprob,
)
from service.decode_sizes import DecodeDecision, DecodePlan
from service.errors import CaptureFailed, RankFailure
from service.rank_info import RankInfo
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.ranks.logprobs import token_logprobs
from service.ranks.runners.base import PrefillRunner
from service.ranks.runners.decode import DecodeGraphRunner
from service.ranks.runners.eager import EagerRunner
from service.ranks.runners.registry import make_runner
from service.ranks.sampler import sample_ids
from service.ranks.slow_watch import watch
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
    # a capture running this long logs where it is, and again each time as long again
    # (service.ranks.slow_watch): warm captures take well under a second
    capture_watch_s = 30.0

    def __init__(self, setup: RankSetup) -> None:
        self.setup = setup
        self.model = setup.model
        self.device = setup.device
        self.req_to_token = setup.req_to_token
        self.kv = setup.kv
        self.eager_runner = EagerRunner(self.model, setup.eager_attention)
        self.runner: PrefillRunner = self.eager_runner
        self.decode_runner: DecodeGraphRunner | None = None

    @property
    def info(self) -> RankInfo:
        return self.setup.info

    @property
    def rank(self) -> int:
        return self.setup.tp.rank

    # ---- start-up: plans and captures --------------------------------------------------------
    def resolve_local_plans(self) -> RankPlans:
        """This rank's legal prefill buckets and decode sizes, from its own request pool."""
        pool = self.info.max_running_requests
        return RankPlans(
            prefill=self.setup.cfg.graph.plan(
                context_length=self.info.context_length,
                pool=ResolvedRequestPool(pool),
                max_prefill_tokens=self.info.chunked_prefill_size,
            ),
            decode=self.setup.cfg.decode.plan(pool, self.device.type),
        )

    def build_runners(self, prefill: BucketPlan, decode: DecodePlan) -> None:
        """The runners of the agreed plans (eager where a plan is empty)."""
        s = self.setup
        self.runner = (
            make_runner(prefill, s.model, s.eager_attention, s.graph_attention, s.device)
            if prefill.enabled
            else self.eager_runner
        )
        self.decode_runner = (
            DecodeGraphRunner(decode, s.model, s.decode_attention, s.device)
            if decode.enabled
            else None
        )

    @torch.inference_mode()
    def capture(self, kind: GraphSet, size: int) -> CaptureResult:
        """Capture one prefill bucket or decode size; any failure comes back as a
        :class:`CaptureFailure` (the coordinator drops it on every rank), or as
        :class:`RankFailure` when the device is unusable afterwards."""
        what = f"rank {self.rank}: capture of {kind} size {size}"
        try:
            with watch(what, self.capture_watch_s, log):
                if kind == "decode":
                    if self.decode_runner is None:
                        raise CaptureFailed("decode graphs are off on this rank")
                    return self.decode_runner.capture(size)
                return self.runner.capture_bucket(size)
        except Exception as exc:
            log.warning("Capture of %s size %d failed: %s: %s", kind, size, type(exc).__name__, exc)
            return capture_failure(
                exc, self.rank, size, self._check_device, self.setup.tp.world_size
            )

    def _check_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def forget(self, kind: GraphSet, size: int) -> None:
        if kind == "decode":
            if self.decode_runner is not None:
                self.decode_runner.forget(size)
        else:
            self.runner.forget(size)

    def captured(self, kind: GraphSet) -> tuple[int, ...]:
        if kind == "decode":
            return self.decode_runner.captured_sizes() if self.decode_runner else ()
        return self.runner.captured_buckets()

    # ---- run time ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self, cmd: ForwardCommand, on_launched: Callable[[], None] | None = None
    ) -> ForwardResult:
        """One forward. ``on_launched`` (the engine delivering the previous step's tokens) runs
        while the device works: after the replay and sampling are queued for a decode graph
        step, at once for host-bound steps (prefill, eager decode), so that nothing waits
        behind their host work."""
        replaying = not cmd.is_prefill and cmd.decode is not None and cmd.decode.hit
        if on_launched is not None and not replaying:
            on_launched()
            on_launched = None
        self.req_to_token.write_many([(w.row, w.start, w.slots) for w in cmd.row_writes])
        layout = BatchLayout(
            mode=ForwardMode.EXTEND if cmd.is_prefill else ForwardMode.DECODE,
            req_pool_indices=cmd.req_pool_indices,
            prefix_lens=cmd.prefix_lens,
            extend_lens=cmd.extend_lens,
        )
        batch = ForwardBatch.build(
            layout, list(cmd.input_ids), list(cmd.out_cache_loc), self.device
        )
        record = decode_record = None
        prompt_logprobs: tuple = ()
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
            logits = self.model.logits(hidden.index_select(0, batch.last_token_indices()))
            if cmd.prompt_scores is not None:
                prompt_logprobs = self._prompt_logprobs(cmd, hidden)
        else:
            step = cmd.decode or DecodeDecision(False, None, 0, MISS_DISABLED)
            if step.hit:
                if self.decode_runner is None or not self.decode_runner.can_replay(step):
                    raise RankFailure(
                        f"rank {self.rank} was told to replay decode size {step.size}, which it "
                        f"has not captured ({list(self.captured('decode'))})"
                    )
                logits = self.decode_runner.run(batch, step)
                kind = self.decode_runner.graph_kind
            else:  # every row of a decode batch is its request's last token
                logits = self.model.logits(
                    self.eager_runner.run(batch, ReplayDecision.miss(MISS_DISABLED))
                )
                kind = "cpu"
            decode_record = DecodeRecord.from_decision(step, layout.num_requests, kind)
        ids = sample_ids(logits, list(cmd.sampling), list(cmd.steps))
        if on_launched is not None:
            on_launched()
        next_ids = ids.tolist()  # the one copy of the step's tokens to the host
        tops = [p.logprobs for p in cmd.sampling]
        logprobs: list[TokenLogprob | None] = [None] * len(tops)
        if any(k is not None for k in tops):
            rows = [i for i, k in enumerate(tops) if k is not None]
            index = torch.tensor(rows, device=logits.device)
            found = token_logprobs(logits[index], ids[index], max(tops[i] for i in rows))
            for i, lp in zip(rows, found, strict=True):
                logprobs[i] = replace(lp, top=lp.top[: tops[i]])
        return ForwardResult(
            logprobs=tuple(logprobs),
            prompt_logprobs=prompt_logprobs,
            next_token_ids=tuple(next_ids),
            record=record,
            # a copy: a replay hands back its graph's output buffer, which the next one overwrites
            logits=logits.to("cpu", copy=True) if cmd.return_logits else None,
            decode_record=decode_record,
        )

    def _prompt_logprobs(
        self, cmd: ForwardCommand, hidden: torch.Tensor
    ) -> tuple[tuple[TokenLogprob, ...] | None, ...]:
        """Per request that asks: each prompt token of its chunk after the first, and the token
        after the chunk, scored by the positions before them."""
        out: list[tuple[TokenLogprob, ...] | None] = []
        start = 0
        for n, score in zip(cmd.extend_lens, cmd.prompt_scores or (), strict=True):
            if score is None:
                out.append(None)
            else:
                targets = list(cmd.input_ids[start + 1 : start + n])
                if score.next_token is not None:
                    targets.append(score.next_token)
                found: list[TokenLogprob] = []
                if targets:
                    rows = hidden[start : start + len(targets)]
                    ids = torch.tensor(targets, device=hidden.device)
                    found = token_logprobs(self.model.logits(rows), ids, score.top)
                out.append(tuple(found))
            start += n
        return tuple(out)

    @property
    def graph_kind(self) -> GraphKind | None:
        return self.runner.graph_kind

    def kv_snapshot(self) -> list[torch.Tensor]:
        """A copy of every layer's K pool (tests check that padding never writes live slots)."""
        return [k.clone().cpu() for k in self.kv.k]
