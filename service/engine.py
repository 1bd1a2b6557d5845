"""The engine: start-up (ranks, agreement, capture), then the scheduler loop.

``Engine.generate`` is the synchronous Python API; the HTTP server drives :meth:`Engine.step`
from its own loop thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from service.chat_template import load_chat_template
from service.commands import ForwardResult
from service.config import EngineConfig
from service.coordinator import start_up
from service.errors import RankFailure, RequestError
from service.executors import make_executor
from service.executors.base import Executor
from service.resolved import ResolvedConfig
from service.sampling import SamplingParams
from service.scheduling.request import Request
from service.scheduling.scheduler import ScheduledBatch, Scheduler
from service.tokenizer import TextTokenizer, load_tokenizer

log = logging.getLogger("service.engine")


@dataclass(frozen=True)
class GenerationOutput:
    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None
    meta_info: dict


@dataclass(frozen=True)
class StepOutcome:
    batch: ScheduledBatch
    result: ForwardResult
    finished: list[Request]


class Engine:
    def __init__(self, cfg: EngineConfig | None = None, executor: Executor | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.executor = executor or make_executor(self.cfg)
        try:
            self.resolved: ResolvedConfig = start_up(self.cfg, self.executor)
        except BaseException:
            self.executor.shutdown()  # no rank actors or Ray left behind by a failed start-up
            raise
        self.tokenizer: TextTokenizer | None = load_tokenizer(Path(self.resolved.model_dir))
        self.chat_template = load_chat_template(Path(self.resolved.model_dir))
        r = self.resolved
        self.scheduler = Scheduler(
            plan=r.plan,
            context_length=r.context_length,
            max_running_requests=r.max_running_requests,
            num_kv_slots=r.num_kv_slots,
            chunked_prefill_size=r.chunked_prefill_size,
            vocab_size=r.vocab_size,
            eos_token_ids=r.eos_token_ids,
            detokenize=self.tokenizer.decode if self.tokenizer else None,
            decode_plan=r.decode,
        )
        self.lock = threading.RLock()
        self.failure: str | None = None  # set once a rank fails; the engine must be rebuilt
        self.return_logits = False
        self.last_logits: list[tuple[ScheduledBatch, ForwardResult]] = []
        log.info(
            "Engine ready: %s on %s (%s), tp %d, context %d, pool %d, kv %d tokens, "
            "backend %s, %d buckets (%s), %d decode sizes (%s)",
            r.limits.architecture,
            r.limits.device,
            r.limits.dtype,
            r.tp,
            r.context_length,
            r.max_running_requests,
            r.num_kv_slots,
            r.plan.backend,
            len(r.plan.buckets),
            r.graph_kind or "eager",
            len(r.decode.sizes),
            r.decode_graph_kind or "eager",
        )

    # ---- the loop ----------------------------------------------------------------------------
    def step(self, on_launched: Callable[[], None] | None = None) -> StepOutcome | None:
        """Run one batch; None when there was nothing to run.

        Whatever goes wrong inside a step (a rank failure, or any bug on this side) fails the
        engine: every request is aborted with the reason, and :class:`RankFailure` is raised, so
        the loop that drives the engine never dies silently with requests waiting forever.
        """
        with self.lock:
            if self.failure is not None:  # before scheduling: a dead engine allocates nothing
                raise RankFailure(self.failure)
            try:
                return self._step(on_launched)
            except Exception as exc:
                named = isinstance(exc, RankFailure)
                self.fail(str(exc) if named else f"{type(exc).__name__}: {exc}")
                raise RankFailure(self.failure) from exc

    def fail(self, reason: str) -> None:
        """Mark the engine failed (first reason kept) and abort every request with it."""
        with self.lock:
            if self.failure is None:
                self.failure = reason.splitlines()[0][:500] if reason else "engine failure"
                log.error("Engine failed: %s", self.failure)
            failed = self.scheduler.abort_all(f"engine failure: {self.failure}")
            if failed:
                log.error("Aborted %d requests: %s", len(failed), self.failure)

    def _step(self, on_launched: Callable[[], None] | None) -> StepOutcome | None:
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        if self.return_logits:
            batch = ScheduledBatch(
                replace(batch.command, return_logits=True), batch.requests, batch.chunk_lens
            )
        result = self.executor.execute(batch.command, on_launched)
        if self.return_logits:
            self.last_logits.append((batch, result))
        if result.record is not None:  # one line per prefill batch, for operators to grep
            log.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #running-req: %d, "
                "#queue-req: %d, graph: %s",
                len(batch.requests),
                result.record.num_tokens,
                len(self.scheduler.running),
                len(self.scheduler.waiting) - len(batch.requests),
                result.record.summary(),
            )
        return StepOutcome(batch, result, self.scheduler.process(batch, result))

    def add(self, prompt: list[int] | str, sampling: SamplingParams, rid: str | None = None):
        with self.lock:
            return self.scheduler.add(self.encode(prompt), sampling, rid)

    def encode(self, prompt: list[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer.json; send input_ids, not text")
            floor = self.tokenizer.min_tokens(prompt)
            if floor > self.resolved.context_length:  # refused before any tokenizing work
                raise RequestError(
                    f"the prompt has at least {floor} tokens, more than the context length "
                    f"{self.resolved.context_length}; shorten the prompt or raise --context-length"
                )
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        sampling: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        params = (
            sampling
            if isinstance(sampling, list)
            else [sampling or SamplingParams()] * len(prompts)
        )
        reqs = [self.add(p, s) for p, s in zip(prompts, params, strict=True)]
        while any(not r.finished for r in reqs):
            self.step()
        errors = [r.error for r in reqs if r.error]
        if errors:
            raise RankFailure(errors[0])
        return [self.output_of(r) for r in reqs]

    def output_of(self, req: Request) -> GenerationOutput:
        text = self.tokenizer.decode(req.output_ids) if self.tokenizer else None
        matched = req.finish_reason.matched if req.finish_reason else None
        if text is not None and isinstance(matched, str):
            text = text[: text.find(matched)]
        return GenerationOutput(
            rid=req.rid,
            prompt_ids=req.prompt_ids,
            output_ids=list(req.output_ids),
            text=text,
            meta_info=meta_info(req),
        )

    def health(self) -> str | None:
        """None when every rank is alive, else why not."""
        if self.failure is not None:
            return self.failure
        reason = self.executor.alive()
        if reason is not None:
            self.fail(reason)
        return self.failure

    def shutdown(self) -> None:
        self.executor.shutdown()


def meta_info(req: Request) -> dict:
    records = [r.to_json() for r in req.prefill_records]
    end = req.finished_at or req.created_at
    return {
        "id": req.rid,
        "finish_reason": req.finish_reason.to_json() if req.finish_reason else None,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "e2e_latency": round(end - req.created_at, 6),
        "prefill_batches": records,
        "cuda_graph": bool(req.prefill_records) and all(r.cuda_graph for r in req.prefill_records),
        "decode_steps": {"graph": req.decode_graph_steps, "eager": req.decode_eager_steps},
    }
