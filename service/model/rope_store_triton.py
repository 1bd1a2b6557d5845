"""Rotary on q and k and the K/V store into the cache, one Triton kernel (CUDA).

``rope_store(qkv, ...)``: qkv (T, (Hq + 2 Hkv) D) is the fused projection (q, k, v column
blocks, rows maybe wider than that); q and k are rotated in place ("rotate half" layout, cos and
sin read from the float32 table at each token's position), and each token's rotated K and its V
are written to its slot of the layer's cache (num_slots + 1, 2, Hkv, D). Before, this was
FlashInfer's rotary kernel, then an indexed copy of K and V: two kernels a layer and one more
pass over k and v (on the H200 at 2,048 tokens, 5.5 + 3.2 us a layer; docs/benchmarks.md,
session 31).

One program per (block of tokens, head): q heads are rotated, k heads rotated and stored, v
heads stored. Padded tokens carry the padding slot, which any number of them may overwrite.
Given the projection's bias (``bias=``; the GEMM then ran without it), each element gets its
column's bias added in float32 first: q and k are rounded once after the rotation, v once after
the add and written back as well as stored (service.model.rope_store_policy.bias_in_rope says
when the model does this).

Numerics: each element is a * cos - b * sin (or b * cos + a * sin) in float32, rounded once to
the input dtype, as the torch reference computes it; the compiler may contract a multiply and
the subtraction into one FMA, so a result can differ from the reference by one rounding.

Imported only where the rank chose it (service.ranks.select.choose_rope_store): it needs triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.model import out_twins
from service.model.rope_store_policy import block_tokens

OP_NAME = "capture_service::rope_store_qkv"
INTO_OP_NAME = "capture_service::rope_store_qkv_into"


@triton.jit
def _rope_store_kernel(
    qkv_ptr,  # (T, >= (HQ + 2 HKV) D), row stride qkv_stride
    qkv_stride,
    out_ptr,  # where rotated q, k (and v, with COPY_V) go: qkv itself, or (T, (HQ + 2 HKV) D)
    out_stride,
    pos_ptr,  # (T,) positions
    cs_ptr,  # (P, D) float32: cos in [0, D/2), sin in [D/2, D); row stride cs_stride
    cs_stride,
    kv_ptr,  # (S + 1, 2, HKV, D): slot stride slot_stride, K at part 0, V at part 1
    slot_stride,
    loc_ptr,  # (T,) slots
    bias_ptr,  # ((HQ + 2 HKV) D,) the projection's bias, added here (HAS_BIAS), else unused
    T,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    COPY_V: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    head = tl.program_id(1)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    live = rows < T
    mask = live[:, None]
    cols = tl.arange(0, HALF)[None, :]
    src = qkv_ptr + rows[:, None].to(tl.int64) * qkv_stride + head * D + cols
    dst_row = out_ptr + rows[:, None].to(tl.int64) * out_stride + head * D + cols
    # float32 from the load on (exact for bf16/fp16): Triton wants one type per name across the
    # constexpr branch, and the bias and the rotation are both done in float32
    a = tl.load(src, mask=mask).to(tl.float32)
    b = tl.load(src + HALF, mask=mask).to(tl.float32)
    if HAS_BIAS:  # added in float32, rounded once with the rotation (v: at its store)
        a = a + tl.load(bias_ptr + head * D + cols).to(tl.float32)
        b = b + tl.load(bias_ptr + head * D + HALF + cols).to(tl.float32)
    slot = tl.load(loc_ptr + rows, mask=live, other=0).to(tl.int64)[:, None]
    if head < HQ + HKV:  # q or k: rotate in place
        pos = tl.load(pos_ptr + rows, mask=live, other=0).to(tl.int64)[:, None]
        table = cs_ptr + pos * cs_stride + cols
        cos = tl.load(table, mask=mask)
        sin = tl.load(table + HALF, mask=mask)
        lo = (a * cos - b * sin).to(qkv_ptr.dtype.element_ty)
        hi = (b * cos + a * sin).to(qkv_ptr.dtype.element_ty)
        tl.store(dst_row, lo, mask=mask)
        tl.store(dst_row + HALF, hi, mask=mask)
        if head >= HQ:  # k: and into the cache
            dst = kv_ptr + slot * slot_stride + (head - HQ) * D + cols
            tl.store(dst, lo, mask=mask)
            tl.store(dst + HALF, hi, mask=mask)
    else:  # v: into the cache as it is (plus the bias)
        lo = a.to(qkv_ptr.dtype.element_ty)
        hi = b.to(qkv_ptr.dtype.element_ty)
        dst = kv_ptr + slot * slot_stride + (HKV * D) + (head - HQ - HKV) * D + cols
        tl.store(dst, lo, mask=mask)
        tl.store(dst + HALF, hi, mask=mask)
        if COPY_V or HAS_BIAS:  # v moved, or changed by the bias
            tl.store(dst_row, lo, mask=mask)
            tl.store(dst_row + HALF, hi, mask=mask)


def fits(qkv: torch.Tensor, heads: tuple[int, int], head_dim: int, kv: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: a row-major qkv of the cache's dtype wide enough
    for the heads, a contiguous two-part cache of ``heads[1]`` K/V heads, a power-of-two D."""
    hq, hkv = heads
    return (
        qkv.is_cuda
        and qkv.dim() == 2
        and qkv.stride(1) == 1
        and qkv.shape[1] >= (hq + 2 * hkv) * head_dim
        and qkv.dtype == kv.dtype
        and qkv.dtype in (torch.float16, torch.bfloat16)
        and kv.is_contiguous()
        and tuple(kv.shape[1:]) == (2, hkv, head_dim)
        and head_dim >= 2
        and head_dim & (head_dim - 1) == 0
    )


def rope_store(
    qkv: torch.Tensor,
    heads: tuple[int, int],
    head_dim: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv: torch.Tensor,
    loc: torch.Tensor,
    out: torch.Tensor | None = None,
    block: int | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """Rotate qkv's q and k heads and store K and V at ``loc`` (T,) in ``kv``; ``heads``:
    (Hq, Hkv). In place, or into ``out`` (T, (Hq + 2 Hkv) D) with v copied there too, qkv left
    as it was. ``block``: tokens per program (default: the policy's; a benchmark's sweep).
    ``bias`` ((Hq + 2 Hkv) D,): the projection's bias, added before the rotation (the GEMM then
    runs without it). The caller checked :func:`fits`."""
    t = qkv.shape[0]
    if t == 0:
        return
    hq, hkv = heads
    bt = block or block_tokens(t)
    grid = (triton.cdiv(t, bt), hq + 2 * hkv)
    dst = qkv if out is None else out
    _rope_store_kernel[grid](
        qkv, qkv.stride(0), dst, dst.stride(0), positions, cos_sin_cache, cos_sin_cache.stride(0),
        kv, kv.stride(0), loc, qkv if bias is None else bias, t, HQ=hq, HKV=hkv, D=head_dim,
        BT=bt, COPY_V=out is not None, HAS_BIAS=bias is not None, num_warps=4,
    )  # fmt: skip


# Under torch.compile (tc_piecewise's pieces) the kernel is one opaque op that returns the
# rotated q, K and V as a new tensor (a custom op may not return an alias of an input, nor
# rotate a traced tensor in place without the compiler copying it first), and writes the cache.
# Declared without mutated arguments, as the store op is (service.ranks.attention.custom_op):
# the cache is read by attention outside the compiled piece, and a declared mutation would have
# the compiler copy a whole layer's cache. Its output feeds the attention op, which orders the
# two and keeps it alive.
@torch.library.custom_op(OP_NAME, mutates_args=())
def rope_store_qkv_op(
    qkv: torch.Tensor,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv: torch.Tensor,
    loc: torch.Tensor,
) -> torch.Tensor:
    out = qkv.new_empty(qkv.shape[0], (heads_q + 2 * heads_kv) * head_dim)
    rope_store(qkv, (heads_q, heads_kv), head_dim, positions, cos_sin_cache, kv, loc, out=out)
    return out


@rope_store_qkv_op.register_fake
def _(qkv, heads_q, heads_kv, head_dim, positions, cos_sin_cache, kv, loc):
    return qkv.new_empty(qkv.shape[0], (heads_q + 2 * heads_kv) * head_dim)


# The op's twin (service.model.out_twins): the same kernel writing q, K and V into ``out``, the
# hand-over buffer a tc_piecewise piece gives it, instead of into a fresh tensor the piece would
# then copy there. ``out`` is the one declared mutation: the piece's caller reads it.
@torch.library.custom_op(INTO_OP_NAME, mutates_args=("out",))
def rope_store_qkv_into_op(
    qkv: torch.Tensor,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv: torch.Tensor,
    loc: torch.Tensor,
    out: torch.Tensor,
) -> None:
    width = (heads_q + 2 * heads_kv) * head_dim
    if out.shape != (qkv.shape[0], width) or out.stride(1) != 1 or out.dtype != qkv.dtype:
        raise ValueError(
            f"rope_store_qkv_into writes a row-major ({qkv.shape[0]}, {width}) {qkv.dtype} "
            f"tensor; got {tuple(out.shape)} {out.dtype} with strides {out.stride()}"
        )
    rope_store(qkv, (heads_q, heads_kv), head_dim, positions, cos_sin_cache, kv, loc, out=out)


@rope_store_qkv_into_op.register_fake
def _(qkv, heads_q, heads_kv, head_dim, positions, cos_sin_cache, kv, loc, out):
    return None


out_twins.register(torch.ops.capture_service.rope_store_qkv,
                   torch.ops.capture_service.rope_store_qkv_into.default)  # fmt: skip
