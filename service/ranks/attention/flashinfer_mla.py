"""MLA decode inside decode graphs: FlashInfer's MLA paged wrapper in CUDA-graph mode.

The MQA path of a decode step (service.model.mla) attends a 576-wide query per head (the
absorbed no-rotary part and the rotary part) over the cache's single 576-wide entry per token
(the latent and the rotary key): FlashInfer's MLA kernel reads that combined entry as it lies in
our pool ("packed" layout, page size 1) and returns the 512-wide latent output per head.

One wrapper per captured decode size, all reading their layout from shared device buffers that
:meth:`prepare` fills on the host before capture and before every replay (FA2/FA3 MLA plans may
be re-planned under a graph). Padded decode slots are sentinels over the padding slot, as for
the other decode attention (service.padding). Prefill (both MLA paths) and eager decode stay on
the torch paths.

Shapes: S decode slots, H heads on this rank, L = kv_lora_rank, C = L + qk_rope_head_dim.
"""

from __future__ import annotations

from typing import Any

import torch

from service.model.attention import MLA_LATENT, AttentionRegistry, BoundAttention
from service.ranks.attention.base import Bound, PlannedAttention
from service.ranks.attention.flashinfer_backend import FLOAT_WORKSPACE_BYTES, live_layout
from service.ranks.attention.paged_layout import paged_layout
from service.ranks.forward_batch import ForwardBatch
from service.ranks.kv_pool import ReqToTokenPool, TokenKVPool


class FlashInferMlaDecodeAttention(PlannedAttention):
    name = "flashinfer_mla_decode"
    graph_safe = True

    def __init__(
        self,
        registry: AttentionRegistry,
        kv: TokenKVPool,
        req_to_token: ReqToTokenPool,
        *,
        kv_lora_rank: int,
        max_size: int,
        kernel: str = "auto",
    ) -> None:
        super().__init__(registry, kv, req_to_token)
        import flashinfer.mla  # the `gpu` extra; select.py decided it is importable

        self.mla = flashinfer.mla
        latent = [s for s in registry.specs() if s.kind == MLA_LATENT]
        if not latent:
            raise ValueError("FlashInfer's MLA decode needs a model with MLA paths")
        self.num_heads, self.scale, self.cache_dim = (
            latent[0].num_heads,
            latent[0].scale,
            latent[0].head_dim,
        )
        self.ckv = kv_lora_rank
        self.device = kv.k[0].device
        self.pin = self.device.type == "cuda"  # host layouts in pinned memory: async copies
        self.dtype = kv.layout.dtype
        major = torch.cuda.get_device_capability(self.device)[0]
        self.backend = kernel if kernel in ("fa2", "fa3") else ("fa3" if major >= 9 else "fa2")
        ctx = req_to_token.context_length

        def z(n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=self.device)

        self.max_size = max_size
        self.workspace = z(FLOAT_WORKSPACE_BYTES, torch.uint8)
        self.qo_indptr = z(max_size + 1)
        self.kv_indptr = z(max_size + 1)
        self.kv_indices = z(max_size * ctx + max_size)
        self.kv_len = z(max_size)
        self._wrappers: dict[int, Any] = {}

    def _wrapper(self, size: int) -> Any:
        if size not in self._wrappers:
            self._wrappers[size] = self.mla.BatchMLAPagedAttentionWrapper(
                self.workspace,
                use_cuda_graph=True,
                qo_indptr=self.qo_indptr[: size + 1],
                kv_indptr=self.kv_indptr[: size + 1],
                kv_indices=self.kv_indices,
                kv_len_arr=self.kv_len[:size],
                backend=self.backend,
            )
        return self._wrappers[size]

    def forget(self, size: int) -> None:
        self._wrappers.pop(size, None)

    def prepare(self, batch: ForwardBatch, size: int) -> None:
        if size > self.max_size:
            raise ValueError(f"decode size {size} exceeds the planned maximum {self.max_size}")
        pl = paged_layout(
            live_layout(batch.layout), self.req_to_token.context_length, size, self.pin
        )
        metadata = self.mla.MLAPlanMetadata.csr(
            torch.arange(size + 1, dtype=torch.int32),  # one query row per slot
            pl.kv_indptr,
            pl.kv_indices(self.req_to_token.table),
            pl.kv_lens,
        )
        self._wrapper(size).plan(
            metadata=metadata,
            num_heads=self.num_heads,
            head_dim_ckv=self.ckv,
            head_dim_kpe=self.cache_dim - self.ckv,
            page_size=1,
            causal=False,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            query_layout="packed",
            kv_cache_layout="packed",
        )

    def bind(self, batch: ForwardBatch) -> BoundAttention:
        size = batch.input_ids.shape[0]

        def attend(q, k, v, key, out):
            spec, q3 = self.heads(q, key)  # (S, H, C)
            if spec.kind != MLA_LATENT:
                raise ValueError(f"{self.name} serves MLA's latent path only, not {key}")
            wrapper = self._wrappers.get(size)
            if wrapper is None:
                raise RuntimeError(f"decode size {size} was not prepared before its graph ran")
            cache = self.kv.kv[spec.kv_layer].view(-1, 1, self.cache_dim)  # (pages, 1, C)
            latent = wrapper.run(query=q3, kv_cache=cache)  # (S, H, L)
            res = torch.empty_like(q3) if out is None else out.view(q3.shape)
            res[..., : self.ckv].copy_(latent)
            res[..., self.ckv :].zero_()  # the layer reads the latent columns only
            return res.view(q.shape[0], -1)

        return Bound(self, batch, attend)
