"""FlashInfer attention over the token KV pool (page size 1), eager and CUDA-graph modes.

Eager (:class:`FlashInferAttention`, every runner's attention between captured segments):
one plan per forward, in :meth:`bind`, then one kernel per layer.

- prefill with no cached prefix: the ragged wrapper over this pass's K/V (contiguous, no gather);
- prefill on top of a prefix (chunked prefill): the paged wrapper over the pool;
- decode: the decode wrapper (tensor-core kernels, which serve any GQA group size).

CUDA graph (:class:`FlashInferGraphAttention`, the ``full`` backend): per captured bucket, two
wrappers in FlashInfer's CUDA-graph mode, one per graph variant: ragged (batches without a cached
prefix, the kernel eager prefill uses) and paged (batches on a prefix). The request axis is fixed
at S slots and the query rows at the bucket; :meth:`prepare` plans on the host outside the graph,
writing the live layout into buffers whose addresses the graph holds, before capture and before
every replay. Buckets and variants share those buffers and one int workspace: only one graph
replays at a time and each replay is preceded by its own plan.

Eager launches: a segment runner attends once per layer over the same views. Through
``Bound.launchers`` it gets, once per forward, the compiled kernel call FlashInfer's ``run`` would
make for each layer, recorded without running (:mod:`~service.ranks.attention.recorded_launch`),
so between two graph replays the host makes that call and nothing else; ragged layers of one
head shape share one call. A plain call (``bound(q, k, v, key, out)``) over the same views
records the call at the first layer and makes it directly for the next.

Padded query rows (past the real tokens) get zeros: the kernels write only planned rows, and a
graph's memory pool would otherwise hand them stale values. A graph's layers share one output
buffer, zeroed once per replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from service.model.attention import (
    AttentionKey,
    AttentionRegistry,
    AttentionSpec,
    BoundAttention,
)
from service.ranks.attention.base import (
    AttendCall,
    AttendCalls,
    Bound,
    Launcher,
    PlannedAttention,
    output_buffer,
)
from service.ranks.attention.flashinfer_replan import RaggedReplan
from service.ranks.attention.paged_layout import PagedLayout, indptr, paged_layout
from service.ranks.attention.recorded_launch import recorded_launch
from service.ranks.attention.sm90_schedule import SM90Rebalance
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.ranks.kv_pool import ReqToTokenPool, TokenKVPool

FLOAT_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-KV scratch
INT_WORKSPACE_BYTES = 8 << 20


@dataclass(frozen=True)
class HeadShape:
    """What a plan depends on; paths with the same shape share wrappers and plans."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float

    @staticmethod
    def of(spec: AttentionSpec) -> HeadShape:
        return HeadShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scale)


class FlashInferBase(PlannedAttention):
    def __init__(
        self,
        registry: AttentionRegistry,
        kv: TokenKVPool,
        req_to_token: ReqToTokenPool,
        kernel: str = "auto",
        workspace: torch.Tensor | None = None,
        balanced: bool = False,
        balance_in_graph: bool = False,
    ) -> None:
        super().__init__(registry, kv, req_to_token)
        import flashinfer  # the `gpu` extra; select.py decided it is importable

        self.fi = flashinfer
        self.kernel = kernel
        self.device = kv.k[0].device
        self.pin = self.device.type == "cuda"  # host layouts in pinned memory: async copies
        self.dtype = kv.layout.dtype
        self.workspace = (
            workspace
            if workspace is not None
            else torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        )
        paths = registry.keys()
        self.shapes = {key: HeadShape.of(registry.spec(key)) for key in paths}
        self.head_shapes = tuple(dict.fromkeys(self.shapes.values()))  # distinct, in order
        # FA3 prefill plans dealt again, longest items first (startup's prefill schedule)
        self.balance = SM90Rebalance(self.device) if balanced else None
        # ``full``'s graph attention: the device rewrite is captured in the graph
        # (graph_prologue), not queued after each plan
        self._defer = balance_in_graph and self.balance is not None and self.balance.on_device

    def _balanced(self, wrapper: Any, shape: HeadShape, same_info: bool = False) -> None:
        """After a prefill plan of ``wrapper``: its FA3 schedule dealt again, where chosen."""
        if self.balance is not None:
            self.balance(wrapper, shape.head_dim, same_info, defer=self._defer)

    def _paged_cache(self, spec: AttentionSpec) -> torch.Tensor:
        # (num_slots+1, 2, Hkv, D) -> (pages, 2, page_size 1, Hkv, D): FlashInfer's combined
        # NHD layout, K and V of a page side by side
        return self.kv.kv[spec.kv_layer].unsqueeze(2)


class FlashInferAttention(FlashInferBase):
    name = "flashinfer"
    graph_safe = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        fi, ws = self.fi, self.workspace
        self._ragged = {
            s: fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=self.kernel)
            for s in self.head_shapes
        }
        self._paged = {
            s: fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=self.kernel)
            for s in self.head_shapes
        }
        self._decode = {
            s: fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
            for s in self.head_shapes
        }

    def path(self, layout: BatchLayout) -> str:
        if layout.mode is ForwardMode.DECODE:
            return "decode"
        return "ragged" if not any(layout.prefix_lens) else "paged"

    def bind(self, batch: ForwardBatch) -> BoundAttention:
        layout = batch.layout
        num_real = layout.num_tokens
        path = self.path(layout)
        wrappers = {"ragged": self._ragged, "paged": self._paged, "decode": self._decode}[path]
        if path == "ragged":  # K/V of this pass only: no KV indices to gather
            qo, pl, kv_indices = indptr(layout.extend_lens, self.pin), None, None
        else:
            pl = paged_layout(layout, self.req_to_token.context_length, pin=self.pin)
            qo, kv_indices = pl.qo_indptr, pl.kv_indices(self.req_to_token.table)
        for shape, wrapper in wrappers.items():
            self._plan(path, wrapper, shape, qo, pl, kv_indices)
        prepared: dict[tuple, Callable[[AttentionKey], torch.Tensor]] = {}

        def attend(q, k, v, key, out):
            # A segment runner calls this once per layer with the same buffers (every layer's
            # q/k/v are columns of one segment buffer, its output one buffer): the views and
            # the wrapper of each layer are worked out once per forward, so the host work per
            # layer is FlashInfer's launch and nothing else.
            if out is None:  # a fresh output each call: nothing to reuse
                return self._launcher(path, wrappers, q, k, v, None, num_real)(key)
            sig = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), q.shape, q.stride(),
                   k.stride(), v.stride(), out.shape, self.shapes[key])  # fmt: skip
            launch = prepared.get(sig)
            if launch is None:
                launch = prepared[sig] = self._launcher(path, wrappers, q, k, v, out, num_real)
            return launch(key)

        def launchers(calls: AttendCalls) -> list[Launcher]:
            # which calls share one launch: ragged attention reads this pass's q/k/v only, so
            # calls over the same tensors and head shape are the same kernel call whatever the
            # layer; paged attention reads the layer's cache (worked out once per bucket)
            groups = calls.memo.get(path)
            if groups is None:
                groups = calls.memo[path] = launch_groups(calls, self.shapes, path == "ragged")
            firsts, index = groups
            made = [self._direct(path, wrappers, calls.calls[i], num_real) for i in firsts]
            return [made[g] for g in index]

        return Bound(self, batch, attend, launchers)

    def _direct(
        self, path: str, wrappers: dict[HeadShape, Any], c: AttendCall, num_real: int
    ) -> Launcher:
        """The kernel call of ``c`` for this forward's plan, recorded without running it; the
        padded output rows zeroed now (the kernel writes the live rows only)."""
        wrapper, args, res_real, _ = self._run_args(
            path, wrappers, c.q, c.k, c.v, c.key, c.out, num_real
        )

        def run() -> Any:
            return wrapper.run(*args, out=res_real)

        return recorded_launch(wrapper, run, execute=False) or run

    def _run_args(
        self,
        path: str,
        wrappers: dict[HeadShape, Any],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key: AttentionKey,
        out: torch.Tensor | None,
        num_real: int,
    ) -> tuple[Any, tuple, torch.Tensor, torch.Tensor]:
        """What ``run`` of layer ``key`` over these tensors takes: its wrapper, the q/k/v (or
        cache) views of the live rows, where it writes, and the (T, Hq*D) result. Padded
        output rows are zeroed here (segment replays), once per call of this."""
        shape = self.shapes[key]
        spec, q3 = self.heads(q, key)
        res = output_buffer(q3, out, num_real)
        if path == "ragged":  # strided q/k/v (columns of one qkv tensor), in place
            k3 = k.view(k.shape[0], spec.num_kv_heads, spec.head_dim)[:num_real]
            v3 = v.view(v.shape[0], spec.num_kv_heads, spec.head_dim)[:num_real]
            args: tuple = (q3[:num_real], k3, v3)
        else:
            args = (q3[:num_real], self._paged_cache(spec))
        return wrappers[shape], args, res[:num_real], res.view(q.shape[0], -1)

    def _launcher(
        self,
        path: str,
        wrappers: dict[HeadShape, Any],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None,
        num_real: int,
    ) -> Callable[[AttentionKey], torch.Tensor]:
        """Attention of these tensors for any layer key: views and slices made once per head
        shape (ragged: layers of one shape share them) or per layer (paged: each layer's
        cache), and padded output rows zeroed once, not once per layer."""
        views: dict[tuple, list] = {}

        def launch(key: AttentionKey) -> torch.Tensor:
            shape = self.shapes[key]
            vkey = (shape, None) if path == "ragged" else (shape, key)
            got = views.get(vkey)
            if got is None:
                made = self._run_args(path, wrappers, q, k, v, key, out, num_real)
                got = views[vkey] = [*made, None]
            wrapper, args, res_real, result, direct = got
            if direct is not None:  # the kernel call FlashInfer's run made for these views
                direct()
            elif out is None:  # a fresh output: this launcher is used once, nothing to record
                wrapper.run(*args, out=res_real)
            else:
                got[4] = recorded_launch(wrapper, lambda: wrapper.run(*args, out=res_real))
            return result

        return launch

    def _plan(
        self,
        path: str,
        wrapper: Any,
        s: HeadShape,
        qo: torch.Tensor,
        pl: PagedLayout | None,
        kv_indices: torch.Tensor | None,
    ) -> None:
        dtypes = {"q_data_type": self.dtype, "kv_data_type": self.dtype}
        if pl is None:  # ragged: the KV indptr is the query indptr
            wrapper.plan(
                qo, qo, s.num_heads, s.num_kv_heads, s.head_dim,
                causal=True, sm_scale=s.scale, **dtypes,
            )  # fmt: skip
            self._balanced(wrapper, s)
        elif path == "paged":
            wrapper.plan(
                qo, pl.kv_indptr, kv_indices, pl.kv_last_page_len,
                s.num_heads, s.num_kv_heads, s.head_dim, 1,
                causal=True, sm_scale=s.scale, **dtypes, **host_lengths(pl),
            )  # fmt: skip
            self._balanced(wrapper, s)
        else:
            wrapper.plan(
                pl.kv_indptr, kv_indices, pl.kv_last_page_len,
                s.num_heads, s.num_kv_heads, s.head_dim, 1,
                sm_scale=s.scale, **dtypes,
            )  # fmt: skip


def launch_groups(
    calls: AttendCalls, shapes: dict[AttentionKey, HeadShape], any_layer: bool
) -> tuple[list[int], list[int]]:
    """The calls that need a launch of their own (indices of the first of each group) and each
    call's group. A group is the same tensors (memory, shape, strides) and head shape, and also
    the same layer unless ``any_layer`` (attention that reads no layer state: ragged, over this
    pass's K/V)."""
    firsts: list[int] = []
    index: list[int] = []
    seen: dict[tuple, int] = {}
    for i, c in enumerate(calls.calls):
        layer = None if any_layer else c.key
        # by memory, not by tensor object: tc_piecewise's pieces hand over fresh views of the
        # same buffers at every layer (one launch each would be a FlashInfer run per layer)
        sig = (*map(_where, (c.q, c.k, c.v, c.out)), shapes[c.key], layer)
        group = seen.get(sig)
        if group is None:
            group = seen[sig] = len(firsts)
            firsts.append(i)
        index.append(group)
    return firsts, index


def _where(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def host_lengths(pl: PagedLayout) -> dict[str, Any]:
    """Plan arguments FlashInfer would otherwise compute from the indptrs with a dozen small
    torch CPU ops per plan (host time before every replay of ``full``)."""
    return {
        "seq_lens": pl.kv_lens,
        "max_token_per_sequence": pl.max_q_len,
        "max_sequence_kv": pl.max_kv_len,
    }


@dataclass(frozen=True)
class GraphPlanBuffers:
    """Device buffers the captured kernels read their layout from (shared by all buckets)."""

    indptrs: torch.Tensor  # (2, S+1) int32: the rows below, filled by one copy per plan
    qo_indptr: torch.Tensor  # (S+1,) int32
    kv_indptr: torch.Tensor  # (S+1,) int32
    kv_indices: torch.Tensor  # (S*context_length + S,) int32
    kv_last_page_len: torch.Tensor  # (S,) int32
    int_workspace: torch.Tensor  # FlashInfer's schedule, written by plan()

    @staticmethod
    def allocate(num_slots: int, context_length: int, device: torch.device) -> GraphPlanBuffers:
        def z(n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        indptrs = z(2 * (num_slots + 1)).view(2, num_slots + 1)
        return GraphPlanBuffers(
            indptrs=indptrs,
            qo_indptr=indptrs[0],
            kv_indptr=indptrs[1],
            kv_indices=z(num_slots * context_length + num_slots),
            kv_last_page_len=z(num_slots),
            int_workspace=z(INT_WORKSPACE_BYTES, torch.uint8),
        )

    @property
    def num_slots(self) -> int:
        return self.kv_last_page_len.shape[0]


def live_layout(layout: BatchLayout) -> BatchLayout:
    """The layout without zero-length entries (a capture batch lists its sentinels)."""
    keep = [i for i, n in enumerate(layout.seq_lens) if n > 0]
    return BatchLayout(
        mode=layout.mode,
        req_pool_indices=tuple(layout.req_pool_indices[i] for i in keep),
        prefix_lens=tuple(layout.prefix_lens[i] for i in keep),
        extend_lens=tuple(layout.extend_lens[i] for i in keep),
    )


class FlashInferGraphAttention(FlashInferBase):
    """Two graph variants per bucket: ``ragged`` for batches without a cached prefix (the K/V
    of this pass, read in place from the qkv projection: the kernel eager prefill uses, no
    gather through the pool) and ``paged`` for batches on a cached prefix (chunked prefill)."""

    name = "flashinfer_graph"
    graph_safe = True
    graph_reads_requests = False  # layouts are planned from the host into the plan buffers
    graph_variants = ("ragged", "paged")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._buffers: GraphPlanBuffers | None = None
        self._wrappers: dict[tuple[int, HeadShape, str], Any] = {}
        self._replans: dict[tuple[int, HeadShape], RaggedReplan] = {}

    def graph_variant(self, layout: BatchLayout) -> str:
        return "paged" if any(layout.prefix_lens) else "ragged"

    def _buffers_for(self, num_slots: int) -> GraphPlanBuffers:
        if self._buffers is None:
            self._buffers = GraphPlanBuffers.allocate(
                num_slots, self.req_to_token.context_length, self.device
            )
        if self._buffers.num_slots != num_slots:
            raise ValueError(
                f"graph attention was planned for {self._buffers.num_slots} request slots, "
                f"not {num_slots}"
            )
        return self._buffers

    def _wrapper(self, bucket: int, shape: HeadShape, variant: str, bufs: GraphPlanBuffers) -> Any:
        # the variants share the plan buffers: each replay is preceded by its own plan
        key = (bucket, shape, variant)
        if key not in self._wrappers:
            if variant == "ragged":  # K/V ranges are the query ranges: one indptr for both
                w = self.fi.BatchPrefillWithRaggedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=bufs.qo_indptr,
                    kv_indptr_buf=bufs.kv_indptr, backend=self.kernel,
                )  # fmt: skip
            else:
                w = self.fi.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True,
                    qo_indptr_buf=bufs.qo_indptr, paged_kv_indptr_buf=bufs.kv_indptr,
                    paged_kv_indices_buf=bufs.kv_indices,
                    paged_kv_last_page_len_buf=bufs.kv_last_page_len, backend=self.kernel,
                )  # fmt: skip
            w.reset_workspace_buffer(self.workspace, bufs.int_workspace)
            self._wrappers[key] = w
        return self._wrappers[key]

    def forget(self, bucket: int) -> None:
        for key in [k for k in self._wrappers if k[0] == bucket]:
            if self.balance is not None:
                self.balance.forget(self._wrappers[key])
            del self._wrappers[key]
        for key in [k for k in self._replans if k[0] == bucket]:
            del self._replans[key]

    def _replan(self, bucket: int, shape: HeadShape, bufs: GraphPlanBuffers) -> RaggedReplan:
        key = (bucket, shape)
        got = self._replans.get(key)
        if got is None:
            wrapper = self._wrapper(bucket, shape, "ragged", bufs)
            dtypes = {"q_data_type": self.dtype, "kv_data_type": self.dtype}

            def plan(qo: torch.Tensor) -> None:  # K/V ranges are the query ranges
                wrapper.plan(
                    qo, qo, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                    causal=True, sm_scale=shape.scale, **dtypes,
                )  # fmt: skip

            # a segment backend's bucket whose plans can never have more items than CTAs
            # (small buckets: the schedule keeps every such plan as FlashInfer made it) is
            # planned as under FlashInfer's schedule, without the checks after each plan or the
            # planner's; full's graph holds its kernel whatever the bucket (graph_prologue)
            balance = self.balance
            if (
                balance is not None
                and not self._defer
                and not balance.may_deal(bucket, bufs.num_slots, shape.num_heads, shape.head_dim)
            ):
                balance = None
            device_plan = None
            if balance is not None and balance.plans_on_device:
                indptr = bufs.indptrs[0]

                def device_plan(lengths: np.ndarray) -> bool:
                    return balance.plan(
                        wrapper, shape.num_heads, shape.head_dim, indptr, lengths, self._defer
                    )

            graph_plan = None
            if device_plan is not None and not self._defer:  # segment backends' replans

                def graph_plan(lengths: np.ndarray) -> bool:
                    return balance.replay_plan(wrapper, shape.num_heads, shape.head_dim, lengths)

            after = None
            if balance is not None:

                def after(same: bool) -> None:
                    self._balanced(wrapper, shape, same)

            hooks_act = None
            if balance is not None and not self._defer:  # full's graph deals every plan

                def hooks_act(lengths: np.ndarray) -> bool:
                    return balance.may_deal_plan(shape.num_heads, shape.head_dim, lengths)

            got = self._replans[key] = RaggedReplan(
                wrapper, bufs.indptrs, plan, after=after, device_plan=device_plan,
                graph_plan=graph_plan, hooks_act=hooks_act,
            )  # fmt: skip
        return got

    def capture_plan_graphs(self, bucket: int) -> int:
        """After the first ragged plans of ``bucket`` (a segment backend's capture): each head
        shape's later plans captured as one graph of the indptr copy and the device planner
        (SM90Rebalance.capture_plan); how many were: none for ``full`` (its graph holds the
        planner), where the planner does not run, or for a bucket whose plans never have more
        items than CTAs (planned as FlashInfer plans them)."""
        if self.balance is None or not self.balance.plans_on_device or self._defer:
            return 0
        made = 0
        for shape in self.head_shapes:
            replan = self._replans.get((bucket, shape))
            if replan is not None and replan.plans_on_device and self.balance.capture_plan(
                replan.wrapper, shape.num_heads, shape.head_dim, replan.indptrs,
                replan.host_indptrs,
            ):  # fmt: skip
                made += 1
        return made

    def graph_prologue(self, bucket: int, variant: str) -> None:
        """The device rewrite of each head shape's plan of ``bucket`` and ``variant``, queued
        (captured, inside ``full``'s capture) after ``prepare``'s plan."""
        if not self._defer:
            return
        for shape in self.head_shapes:
            wrapper = self._wrappers.get((bucket, shape, variant))
            if wrapper is None:
                continue
            replan = self._replans.get((bucket, shape)) if variant == "ragged" else None
            # the ragged plans made on the device (the host then skips FlashInfer's plan), else
            # FlashInfer's plan dealt again
            if replan is None or not self.balance.launch_plan(
                wrapper, shape.num_heads, shape.head_dim, replan.indptrs[0]
            ):
                self.balance.launch(wrapper, shape.head_dim)

    def prepare(
        self, batch: ForwardBatch, bucket: int, variant: str = "paged", num_slots: int | None = None
    ) -> None:
        """Plan ``variant`` of ``bucket`` for this batch, over ``num_slots`` request slots
        (default: the batch's request tensors' length; the ragged variant reads only the host
        layout, so a caller that did not pad the request tensors passes the slots)."""
        if num_slots is None:
            num_slots = batch.req_pool_indices.shape[0]
        bufs = self._buffers_for(num_slots)
        layout = batch.layout
        if variant == "ragged":
            if any(layout.prefix_lens):
                raise ValueError("the ragged graph serves batches without a cached prefix")
            # sentinel requests (zero lengths, listed by a capture batch or padded here): no
            # query rows and no K/V, so they generate no work
            lens = np.zeros(num_slots, dtype=np.int64)
            lens[: layout.num_requests] = layout.extend_lens
            for shape in self.head_shapes:
                self._replan(bucket, shape, bufs)(lens)
            return
        live = live_layout(layout)
        dtypes = {"q_data_type": self.dtype, "kv_data_type": self.dtype}
        pl = paged_layout(live, self.req_to_token.context_length, num_slots, self.pin)
        kv_indices = pl.kv_indices(self.req_to_token.table)
        for shape in self.head_shapes:
            wrapper = self._wrapper(bucket, shape, variant, bufs)
            wrapper.plan(
                pl.qo_indptr, pl.kv_indptr, kv_indices, pl.kv_last_page_len,
                shape.num_heads, shape.num_kv_heads, shape.head_dim, 1,
                causal=True, sm_scale=shape.scale, **dtypes, **host_lengths(pl),
            )  # fmt: skip
            self._balanced(wrapper, shape)

    def ragged_launchers(self, bucket: int, calls: AttendCalls, num_real: int) -> list[Launcher]:
        """Eager launches of the ragged wrappers of ``bucket`` over a segment runner's calls,
        after :meth:`prepare` (``ragged``) planned this forward. Made once per bucket and kept:
        in CUDA-graph mode a wrapper's plan buffers and plan info stay the same from plan to plan
        (:class:`RaggedReplan` checks it), so the recorded kernel calls stay valid. Rows past
        ``num_real`` (no request plans them) are zeroed in every output, once per forward."""
        got = calls.memo.get(("graph", bucket))
        if got is None:
            firsts, index = launch_groups(calls, self.shapes, any_layer=True)
            made = [self._ragged_direct(bucket, calls.calls[i]) for i in firsts]
            outs = list({_where(c.out): c.out for c in calls.calls}.values())
            got = calls.memo[("graph", bucket)] = ([made[g] for g in index], outs)
        launches, outs = got
        for out in outs:
            if out.shape[0] > num_real:
                out[num_real:].zero_()
        return launches

    def _ragged_direct(self, bucket: int, c: AttendCall) -> Launcher:
        shape = self.shapes[c.key]
        wrapper = self._wrappers.get((bucket, shape, "ragged"))
        if wrapper is None:
            raise RuntimeError(f"bucket {bucket} was not prepared before its launches")
        spec, q3 = self.heads(c.q, c.key)
        t, h, d = c.k.shape[0], spec.num_kv_heads, spec.head_dim
        k3, v3, res = c.k.view(t, h, d), c.v.view(t, h, d), c.out.view(q3.shape)

        def run() -> Any:
            return wrapper.run(q3, k3, v3, out=res)

        return recorded_launch(wrapper, run, execute=False) or run

    def bind(self, batch: ForwardBatch) -> BoundAttention:
        return self.bind_variant(batch, "paged")

    def bind_variant(self, batch: ForwardBatch, variant: str) -> BoundAttention:
        bucket = batch.input_ids.shape[0]
        # One output per head shape for all the layers this binding serves (one graph of
        # `full`'s chain), zeroed once per replay, not once per layer: the kernels write the
        # planned (live) rows only, so the padded rows stay 0 through every layer, and each
        # layer's output is consumed by its o_proj before the next layer's attention
        # overwrites the live rows.
        shared: dict[tuple[int, ...], torch.Tensor] = {}

        def attend(q, k, v, key, out):
            spec, q3 = self.heads(q, key)
            wrapper = self._wrappers.get((bucket, self.shapes[key], variant))
            if wrapper is None:
                raise RuntimeError(f"bucket {bucket} was not prepared before its graph ran")
            if out is not None:
                res = out.view(q3.shape).zero_()
            elif (res := shared.get(q3.shape)) is None:
                res = shared[q3.shape] = torch.zeros_like(q3)
            if variant == "ragged":  # strided k/v (columns of one qkv tensor), read in place
                t, h, d = k.shape[0], spec.num_kv_heads, spec.head_dim
                wrapper.run(q3, k.view(t, h, d), v.view(t, h, d), out=res)
            else:
                wrapper.run(q3, self._paged_cache(spec), out=res)
            return res.view(q.shape[0], -1)

        return Bound(self, batch, attend)
