"""FlashInfer decode attention inside decode graphs: the decode wrapper in CUDA-graph mode.

One wrapper per captured decode size (its batch axis is fixed) and head shape, all reading their
layout from shared device buffers: :meth:`prepare` plans on the host, outside the graph, before
capture and before every replay, writing the live layout there. Padded decode slots are
sentinels with one KV entry, the padding slot (service.padding), so no kernel sees an empty KV
range and none reads a live request's KV for them. Tensor-core kernels serve any GQA group.
"""

from __future__ import annotations

from typing import Any

import torch

from service.model.attention import BoundAttention
from service.ranks.attention.base import Bound
from service.ranks.attention.flashinfer_backend import (
    INT_WORKSPACE_BYTES,
    FlashInferBase,
    HeadShape,
    live_layout,
)
from service.ranks.attention.paged_layout import paged_layout
from service.ranks.forward_batch import ForwardBatch


class FlashInferDecodeGraphAttention(FlashInferBase):
    name = "flashinfer_decode_graph"
    graph_safe = True

    def __init__(self, *args: Any, max_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ctx = self.req_to_token.context_length

        def z(n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=self.device)

        self.max_size = max_size
        self.kv_indptr = z(max_size + 1)
        self.kv_indices = z(max_size * ctx + max_size)
        self.kv_last_page_len = z(max_size)
        self.int_workspace = z(INT_WORKSPACE_BYTES, torch.uint8)
        self._wrappers: dict[tuple[int, HeadShape], Any] = {}

    def _wrapper(self, size: int, shape: HeadShape) -> Any:
        key = (size, shape)
        if key not in self._wrappers:
            w = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, backend="fa2",
                paged_kv_indptr_buffer=self.kv_indptr[: size + 1],
                paged_kv_indices_buffer=self.kv_indices,
                paged_kv_last_page_len_buffer=self.kv_last_page_len[:size],
            )  # fmt: skip
            w.reset_workspace_buffer(self.workspace, self.int_workspace)
            self._wrappers[key] = w
        return self._wrappers[key]

    def forget(self, size: int) -> None:
        for key in [k for k in self._wrappers if k[0] == size]:
            del self._wrappers[key]

    def prepare(self, batch: ForwardBatch, size: int) -> None:
        if size > self.max_size:
            raise ValueError(f"decode size {size} exceeds the planned maximum {self.max_size}")
        pl = paged_layout(
            live_layout(batch.layout), self.req_to_token.context_length, size, self.pin
        )
        kv_indices = pl.kv_indices(self.req_to_token.table)
        for shape in self.head_shapes:
            self._wrapper(size, shape).plan(
                pl.kv_indptr, kv_indices, pl.kv_last_page_len,
                shape.num_heads, shape.num_kv_heads, shape.head_dim, 1,
                sm_scale=shape.scale, q_data_type=self.dtype, kv_data_type=self.dtype,
            )  # fmt: skip

    def bind(self, batch: ForwardBatch) -> BoundAttention:
        size = batch.input_ids.shape[0]

        def attend(q, k, v, key, out):
            spec, q3 = self.heads(q, key)
            wrapper = self._wrappers.get((size, self.shapes[key]))
            if wrapper is None:
                raise RuntimeError(f"decode size {size} was not prepared before its graph ran")
            res = torch.empty_like(q3) if out is None else out.view(q3.shape)
            wrapper.run(q3, self._paged_cache(spec), out=res)
            return res.view(q.shape[0], -1)

        return Bound(self, batch, attend)
