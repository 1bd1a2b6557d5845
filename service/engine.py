"""The engine: start-up (ranks, agreement, capture), then the scheduler loop.

``Engine.generate`` is the synchronous Python API; the HTTP server drives :meth:`Engine.step`
from its own loop thread.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from service.commands import ForwardResult
from service.config import EngineConfig
from service.coordinator import start_up
from service.executor import Executor, LocalExecutor, RankFailure
from service.resolved import ResolvedConfig
from service.sampling import SamplingParams
from service.scheduler import Request, RequestError, ScheduledBatch, Scheduler
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


def make_executor(cfg: EngineConfig) -> Executor:
    if cfg.executor == "local" or (
        cfg.executor == "auto" and cfg.tp == 1 and cfg.ray_address is None
    ):
        return LocalExecutor(cfg)
    from service.ray_executor import RayExecutor

    return RayExecutor(cfg)


class Engine:
    def __init__(self, cfg: EngineConfig | None = None, executor: Executor | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.executor = executor or make_executor(self.cfg)
        self.resolved: ResolvedConfig = start_up(self.cfg, self.executor)
        self.tokenizer: TextTokenizer | None = load_tokenizer(Path(self.resolved.model_dir))
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
        )
        self.lock = threading.RLock()
        self.failure: str | None = None  # set once a rank fails; the engine must be rebuilt
        self.return_logits = False
        self.last_logits: list[tuple[ScheduledBatch, ForwardResult]] = []
        log.info(
            "Engine ready: %s on %s (%s), tp %d, context %d, pool %d, kv %d tokens, "
            "backend %s, %d buckets (%s)",
            r.architecture,
            r.device,
            r.dtype,
            r.tp,
            r.context_length,
            r.max_running_requests,
            r.num_kv_slots,
            r.plan.backend,
            len(r.plan.buckets),
            r.graph_kind or "eager",
        )

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> StepOutcome | None:
        """Run one batch; None when there was nothing to run."""
        with self.lock:
            if self.failure is not None:  # before scheduling: a dead engine allocates nothing
                raise RankFailure(self.failure)
            batch = self.scheduler.schedule()
            if batch is None:
                return None
            if self.return_logits:
                batch = ScheduledBatch(
                    replace(batch.command, return_logits=True), batch.requests, batch.chunk_lens
                )
            try:
                result = self.executor.execute(batch.command)
            except RankFailure as exc:
                self.failure = str(exc)
                failed = self.scheduler.abort_all(f"engine failure: {exc}")
                log.error("Aborted %d requests: %s", len(failed), exc)
                raise
            if self.return_logits:
                self.last_logits.append((batch, result))
            if result.record is not None:
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
        if (
            text is not None
            and req.finish_reason
            and isinstance(req.finish_reason.get("matched"), str)
        ):
            text = text[: text.find(req.finish_reason["matched"])]
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
            self.failure = reason
        return reason

    def shutdown(self) -> None:
        self.executor.shutdown()


def meta_info(req: Request) -> dict:
    records = [r.to_json() for r in req.prefill_records]
    end = req.finished_at or req.created_at
    return {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "e2e_latency": round(end - req.created_at, 6),
        "prefill_batches": records,
        "cuda_graph": bool(req.prefill_records) and all(r.cuda_graph for r in req.prefill_records),
    }
