"""Continuous batching: which requests prefill or decode next, with which rows and KV slots.

Pure Python (no torch). Prefill batches take waiting requests in arrival order under the token
budget (chunked prefill: a long prompt is split across batches, each chunk an extend on top of
the cached prefix); running requests then decode together. Each prefill batch gets its graph
decision here, once, from the agreed plan, and the same command goes to every rank.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from service.buckets import BucketPlan, decide_replay
from service.commands import ForwardCommand, ForwardResult, PromptScore, RowWrite
from service.decode_sizes import DecodePlan, decide_decode
from service.errors import RequestError
from service.sampling import SamplingParams
from service.scheduling.allocators import RowAllocator, SlotAllocator
from service.scheduling.request import FinishReason, Request

# the share of a request's remaining token limit that admission keeps free in the KV cache:
# clients rarely use all of max_new_tokens, and retraction catches the cases that do
NEW_TOKEN_RATIO = 0.5


@dataclass(frozen=True)
class ScheduledBatch:
    command: ForwardCommand
    requests: tuple[Request, ...]
    chunk_lens: tuple[int, ...]


class Scheduler:
    def __init__(
        self,
        *,
        plan: BucketPlan,
        context_length: int,
        max_running_requests: int,
        num_kv_slots: int,
        chunked_prefill_size: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        detokenize: Callable[[list[int]], str] | None = None,
        decode_plan: DecodePlan | None = None,
    ) -> None:
        self.plan = plan
        self.decode_plan = decode_plan or DecodePlan((), max_running_requests)
        self.context_length = context_length
        self.chunked_prefill_size = chunked_prefill_size
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.detokenize = detokenize
        self.rows = RowAllocator(max_running_requests)
        self.slots = SlotAllocator(num_kv_slots)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._counter = 0
        self.num_retractions = 0  # requests that gave up their KV to let others decode

    # ---- admission ---------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty; send at least one token")
        if len(prompt_ids) > self.context_length:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens, more than the context length "
                f"{self.context_length}; shorten the prompt or raise --context-length"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )

    def add(
        self, prompt_ids: list[int], sampling: SamplingParams, rid: str | None = None
    ) -> Request:
        self.validate(prompt_ids)
        if sampling.seed is None and not sampling.greedy:
            sampling = replace(sampling, seed=random.getrandbits(31))
        self._counter += 1
        req = Request(
            rid=rid or f"req-{self._counter}", prompt_ids=list(prompt_ids), sampling=sampling
        )
        self.waiting.append(req)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling --------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _limits(self) -> tuple[int, int]:
        """Token budget and request cap of one prefill batch.

        Bucket-aware: with graphs on, a batch never grows past the largest captured bucket (a
        long prompt is chunked to fit it instead) and, for ``full``, never past the S request
        slots, so batches that could replay are not pushed into a miss by one more request.
        """
        budget, cap = self.chunked_prefill_size, self.rows.num_rows
        if self.plan.enabled:
            budget = min(budget, max(self.plan.bucket_sizes))
            if self.plan.backend == "full":
                cap = min(cap, self.plan.capture_request_capacity)
        return budget, cap

    def _reserve(self, reqs: list[Request]) -> int:
        """KV slots to keep free for the decode of ``reqs``: an estimate of their output
        (NEW_TOKEN_RATIO of what they may still generate); retraction covers a wrong estimate."""
        return sum(
            math.ceil(r.remaining_tokens(self.context_length) * NEW_TOKEN_RATIO) for r in reqs
        )

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget, max_requests = self._limits()
        reqs: list[Request] = []
        chunks: list[int] = []
        writes: list[RowWrite] = []
        input_ids: list[int] = []
        locs: list[int] = []
        reserve = self._reserve(self.running)
        for req in self.waiting:
            if budget == 0 or len(reqs) == max_requests:
                break
            n = min(len(req.prefill_ids) - req.num_prefilled, budget)
            # admit only with room left for the expected output of everything admitted; a
            # batch with nothing running yet always takes its first request
            reserve += self._reserve([req])
            if self.slots.num_free - n < reserve and (self.running or reqs):
                break
            new_row = req.row is None
            if new_row:
                req.row = self.rows.alloc()
                if req.row is None:
                    break
            slots = self.slots.alloc(n)
            if slots is None:
                if new_row:
                    self.rows.free(req.row)
                    req.row = None
                break
            writes.append(RowWrite(req.row, req.num_cached, tuple(slots)))
            input_ids += req.prefill_ids[req.num_prefilled : req.num_prefilled + n]
            locs += slots
            req.slots += slots
            reqs.append(req)
            chunks.append(n)
            budget -= n
        if not reqs:
            return None
        num_tokens = sum(chunks)
        scores = [
            PromptScore(
                r.sampling.prompt_logprobs,
                r.prefill_ids[r.num_prefilled + n] if r.num_prefilled + n < len(r.prefill_ids)
                else None,
            )
            if r.sampling.prompt_logprobs is not None and r.retractions == 0
            else None
            for r, n in zip(reqs, chunks, strict=True)
        ]  # fmt: skip
        cmd = ForwardCommand(
            is_prefill=True,
            req_pool_indices=tuple(r.row for r in reqs),
            prefix_lens=tuple(r.num_cached - n for r, n in zip(reqs, chunks, strict=True)),
            extend_lens=tuple(chunks),
            input_ids=tuple(input_ids),
            out_cache_loc=tuple(locs),
            row_writes=tuple(writes),
            sampling=tuple(r.sampling for r in reqs),
            steps=tuple(len(r.output_ids) for r in reqs),
            decision=decide_replay(self.plan, num_tokens, len(reqs)),
            prompt_scores=tuple(scores) if any(scores) else None,
        )
        return ScheduledBatch(cmd, tuple(reqs), tuple(chunks))

    def _schedule_decode(self) -> ScheduledBatch | None:
        for req in list(self.running):
            if req.num_cached >= self.context_length:
                self._finish(req, FinishReason.at_length(len(req.output_ids)))
        self.running = [r for r in self.running if not r.finished]
        # one new KV slot per running request: when the cache cannot give that, the requests
        # admitted last give theirs up (retraction) until it can; one request always remains
        while len(self.running) > 1 and self.slots.num_free < len(self.running):
            self._retract(self.running[-1])
        reqs: list[Request] = []
        writes: list[RowWrite] = []
        locs: list[int] = []
        for req in list(self.running):
            slots = self.slots.alloc(1)
            if slots is None:  # a single request whose context no longer fits: unreachable
                self._finish(req, FinishReason.abort("KV cache is full; lower the load"))
                continue
            writes.append(RowWrite(req.row, req.num_cached, tuple(slots)))
            req.slots += slots
            locs += slots
            reqs.append(req)
        if not reqs:
            return None
        cmd = ForwardCommand(
            is_prefill=False,
            req_pool_indices=tuple(r.row for r in reqs),
            prefix_lens=tuple(r.num_cached - 1 for r in reqs),
            extend_lens=(1,) * len(reqs),
            input_ids=tuple(r.output_ids[-1] for r in reqs),
            out_cache_loc=tuple(locs),
            row_writes=tuple(writes),
            sampling=tuple(r.sampling for r in reqs),
            steps=tuple(len(r.output_ids) for r in reqs),
            decision=None,
            decode=decide_decode(self.decode_plan, len(reqs)),
        )
        return ScheduledBatch(cmd, tuple(reqs), (1,) * len(reqs))

    def _retract(self, victim: Request) -> None:
        """Give up ``victim``'s KV: it goes back to the front of the queue and later resumes by
        recomputing its prompt and what it generated so far. Nothing it generated is lost."""
        self.running.remove(victim)
        self.slots.free(victim.slots)
        victim.slots = []
        if victim.row is not None:
            self.rows.free(victim.row)
            victim.row = None
        victim.prefill_ids = victim.prompt_ids + victim.output_ids
        victim.num_prefilled = 0
        victim.retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(victim)

    # ---- results -----------------------------------------------------------------------------
    @property
    def kv_usage(self) -> float:
        return self.slots.num_used / max(1, self.slots.num_slots)

    def process(self, batch: ScheduledBatch, result: ForwardResult) -> list[Request]:
        """Apply a forward's sampled tokens; returns the requests that finished."""
        done: list[Request] = []
        now = time.perf_counter()
        for i, (req, n, token) in enumerate(
            zip(batch.requests, batch.chunk_lens, result.next_token_ids, strict=True)
        ):
            if req.finished:  # aborted while the batch ran
                continue
            if result.decode_record is not None:
                if result.decode_record.graph_hit:
                    req.decode_graph_steps += 1
                else:
                    req.decode_eager_steps += 1
            if result.prompt_logprobs and result.prompt_logprobs[i] is not None:
                req.prompt_logprobs += result.prompt_logprobs[i]
            if batch.command.is_prefill:
                req.num_prefilled += n
                if result.record is not None:
                    req.prefill_records.append(result.record)
                if not req.prefilled:
                    continue  # more chunks to go; no token sampled from a partial prompt
                self.waiting.remove(req)
                self.running.append(req)
            req.output_ids.append(token)
            if result.logprobs and result.logprobs[i] is not None:
                req.output_logprobs.append(result.logprobs[i])
            if req.first_token_at is None:
                req.first_token_at = now
            reason = self._finish_reason(req, token)
            if reason is not None:
                self._finish(req, reason)
        for req in list(self.running) + list(self.waiting):
            if req.finished:
                done.append(req)
        self.running = [r for r in self.running if not r.finished]
        self.waiting = deque(r for r in self.waiting if not r.finished)
        return done

    def _finish_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.sampling
        if not p.ignore_eos and token in self.eos_token_ids:
            return FinishReason.stop(token)
        if token in p.stop_token_ids:
            return FinishReason.stop(token)
        if p.stop and self.detokenize is not None:
            # A stop string is checked every step, so it can only just have completed: decoding
            # a tail that covers its bytes (4 per character at most, one byte or more per
            # token) suffices, instead of the whole output on every step.
            window = 4 * max(len(s) for s in p.stop) + 4
            text = self.detokenize(req.output_ids[-window:])
            for s in p.stop:
                if s in text:
                    return FinishReason.stop(s)
        if len(req.output_ids) >= p.max_new_tokens:
            return FinishReason.at_length(len(req.output_ids))
        if req.num_cached + 1 > self.context_length:
            return FinishReason.at_length(len(req.output_ids))
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        req.finished_at = time.perf_counter()
        if req.row is not None:
            self.rows.free(req.row)
            req.row = None
        self.slots.free(req.slots)
        req.slots = []

    def abort(self, req: Request, message: str) -> None:
        """End a request now (client gone, engine failure), freeing its row and KV slots."""
        if req.finished:
            return
        req.error = message
        self._finish(req, FinishReason.abort(message))
        self.running = [r for r in self.running if r is not req]
        self.waiting = deque(r for r in self.waiting if r is not req)

    def abort_all(self, message: str) -> list[Request]:
        reqs = list(self.waiting) + list(self.running)
        for req in reqs:
            self.abort(req, message)
        return reqs
