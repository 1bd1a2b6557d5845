"""What one tensor-parallel rank runs: its model shard, KV pools, attention and prefill runner.

The body of a Ray actor at tp>1 and an in-process object at tp=1. It decides nothing that must
agree across ranks: rows, slots and graph decisions arrive in each :class:`ForwardCommand`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from service.buckets import (
    MISS_DISABLED,
    BucketPlan,
    PlanError,
    ReplayDecision,
    ResolvedRequestPool,
    resolve_plan,
)
from service.commands import ForwardCommand, ForwardResult, GraphRecord
from service.config import DEFAULT_MAX_RUNNING_REQUESTS_CAP, EngineConfig, GraphConfig
from service.model.arch_config import load_arch_config
from service.model.builtin import builtin_model_dir
from service.model.loader import build_model
from service.model.parallel import TPGroup
from service.ranks.attention.base import AttentionBackend
from service.ranks.attention.select import (
    AttentionChoice,
    choose_attention,
    flashinfer_import_error,
)
from service.ranks.attention.torch_slots import TorchSlotAttention
from service.ranks.attention.torch_varlen import TorchVarlenAttention
from service.ranks.device import (
    resolve_chunked_prefill,
    resolve_context_length,
    resolve_device,
    resolve_dtype,
    resolve_kv_budget,
)
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.ranks.kv_pool import (
    KVLayout,
    ReqToTokenPool,
    TokenKVPool,
    kv_slots_for_budget,
    resolve_max_running_requests,
)
from service.ranks.runners.base import CaptureFailed, CaptureStat, PrefillRunner
from service.ranks.runners.eager import EagerRunner
from service.ranks.sampler import sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    """What a rank resolved at start-up; the coordinator agrees across ranks from these."""

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
    attention: AttentionChoice


def model_dir_of(cfg: EngineConfig) -> Path:
    return Path(cfg.model_path) if cfg.model_path else builtin_model_dir()


class RankWorker:
    def __init__(
        self,
        cfg: EngineConfig,
        tp: TPGroup | None = None,
        local_gpu: int = 0,
        max_running_requests_override: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.tp = tp or TPGroup()
        self.model_dir = model_dir_of(cfg)
        arch = load_arch_config(self.model_dir)
        self.device = resolve_device(cfg, local_gpu)
        self.dtype = resolve_dtype(cfg, arch, self.device)
        self.context_length = resolve_context_length(cfg, arch)
        self.chunked_prefill_size = resolve_chunked_prefill(cfg, self.device)
        self.model = build_model(
            self.model_dir,
            tp=self.tp,
            max_positions=max(self.context_length, 1),
            dtype=self.dtype,
            device=self.device,
            load_format=cfg.load_format,
            seed=cfg.seed,
            cfg=arch,
        )
        layout = KVLayout(
            num_layers=arch.num_hidden_layers,
            num_kv_heads=self.model.layers[0].self_attn.num_kv_heads,
            head_dim=arch.head_dim,
            dtype=self.dtype,
        )
        num_slots = kv_slots_for_budget(layout, resolve_kv_budget(cfg, self.device))
        user_pool = max_running_requests_override or cfg.max_running_requests
        self.max_running_requests = resolve_max_running_requests(
            user_pool, num_slots, self.context_length, DEFAULT_MAX_RUNNING_REQUESTS_CAP
        )
        self.kv = TokenKVPool(layout, num_slots, self.device)
        self.req_to_token = ReqToTokenPool(
            self.max_running_requests, self.context_length, self.device
        )
        self.attention = choose_attention(
            cfg.attention_backend,
            self.device.type,
            str(self.dtype).removeprefix("torch."),
            arch.head_dim,
            flashinfer_import_error()
            if self.device.type == "cuda" and cfg.attention_backend != "torch"
            else None,
        )
        log.info("Attention backend: %s (%s)", self.attention.name, self.attention.reason)
        self.eager_attention, self.graph_attention = self._attention_backends(cfg)
        self.eager_runner = EagerRunner(self.model, self.eager_attention)
        self.runner: PrefillRunner = self.eager_runner
        self.info = RankInfo(
            rank=self.tp.rank,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            context_length=self.context_length,
            max_running_requests=self.max_running_requests,
            num_kv_slots=num_slots,
            chunked_prefill_size=self.chunked_prefill_size,
            vocab_size=arch.vocab_size,
            eos_token_ids=arch.eos_token_ids,
            model_dir=str(self.model_dir),
            architecture=arch.architecture,
            attention=self.attention,
        )

    def _attention_backends(self, cfg: EngineConfig) -> tuple[AttentionBackend, AttentionBackend]:
        """(eager attention, graph-safe attention of the ``full`` backend) for the choice."""
        args = (self.model.registry, self.kv, self.req_to_token)
        if self.attention.name == "flashinfer":
            from service.ranks.attention.flashinfer_backend import (
                FlashInferAttention,
                FlashInferGraphAttention,
            )

            eager = FlashInferAttention(*args, kernel=cfg.flashinfer_kernel)
            graph = FlashInferGraphAttention(
                *args, kernel=cfg.flashinfer_kernel, workspace=eager.workspace
            )
            return eager, graph
        return TorchVarlenAttention(*args), TorchSlotAttention(*args)

    # ---- start-up: buckets -----------------------------------------------------------------
    def resolve_local_plan(self, graph: GraphConfig | None = None) -> BucketPlan:
        """This rank's legal bucket set, from its own resolved request pool."""
        g = graph or self.cfg.graph
        return resolve_plan(
            backend=g.backend,
            context_length=self.context_length,
            pool=ResolvedRequestPool(self.max_running_requests),
            max_prefill_tokens=self.chunked_prefill_size,
            buckets=g.buckets,
            full_request_slots=g.full_request_slots,
            max_padding_fraction=g.max_padding_fraction,
        )

    def build_runner(self, plan: BucketPlan) -> None:
        """Build the graph runner for an agreed, non-empty plan (nothing for an empty one)."""
        if not plan.enabled:
            self.runner = self.eager_runner
            return
        from service.ranks.runners.registry import make_runner

        self.runner = make_runner(plan, self)

    @torch.inference_mode()
    def capture_bucket(self, plan: BucketPlan, num_tokens: int) -> CaptureStat | str:
        """Capture one bucket; a failure is returned as its reason (the coordinator drops it)."""
        try:
            stat = self.runner.capture_bucket(plan, num_tokens)
        except (CaptureFailed, RuntimeError, PlanError) as exc:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
            return f"rank {self.tp.rank}: {type(exc).__name__}: {exc}"
        return stat

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
                raise PlanError(
                    f"rank {self.tp.rank} was told to replay bucket {decision.bucket}, which it "
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
    def graph_kind(self):
        return self.runner.graph_kind

    def kv_snapshot(self) -> list[torch.Tensor]:
        """A copy of every layer's K pool (tests check that padding never writes live slots)."""
        return [k.clone().cpu() for k in self.kv.k]
