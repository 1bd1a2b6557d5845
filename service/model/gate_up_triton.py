"""The MLP's gate_up GEMM and SiLU-and-mul in one Triton kernel (CUDA, sm90: TMA loads/stores).

``gate_up_silu(x, weight)``: x (T, H), weight (2I, H) with gate rows [0, I) and up rows [I, 2I)
(ColumnParallelLinear's layout, per rank) -> silu(x Wg^T) * (x Wu^T), (T, I). Each program
computes a tile of gate and the matching tile of up from one pass over x, and applies the
activation to the fp32 accumulators, so the (T, 2I) product is never written. Where
service.model.gate_up_tiles says the pair is faster (or the shape does not fit), it runs
``F.linear`` and the rank's SiLU-and-mul instead.

Numerics: the activation sees fp32 products, where the pair rounds them to the weight dtype
first; results differ from the pair by about one rounding of the output (tests/test_gate_up.py
states the tolerance). Below 2,048 tokens only captured calls take the kernel (eager calls are
host-bound there, and its launch costs the host more), so a replay and an eager call of the same
batch can differ by that rounding.

Imported only where the rank chose it (service.ranks.select.choose_gate_up): it needs triton.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.nn import functional as F
from triton.tools.tensor_descriptor import TensorDescriptor

from service.model.gate_up_tiles import Tile, half_stripes, shape_blocker, tile_for

OP_NAME = "capture_service::gate_up_silu"


@triton.jit
def _tile(x_desc, w_desc, out_desc, row, col, N, K: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """One program's tile: rows [row, row + BM) by output columns [col, col + BN)."""
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = x_desc.load([row, k])
        # the last gate tile may run into up's rows when BN does not divide N: those columns
        # are past N, and the store clips them; loads past 2N read zeros
        acc_g = tl.dot(a, w_desc.load([col, k]).T, acc_g)
        acc_u = tl.dot(a, w_desc.load([N + col, k]).T, acc_u)
    y = acc_g * tl.sigmoid(acc_g) * acc_u
    out_desc.store([row, col], y.to(out_desc.dtype))


@triton.jit
def _grouped(pid, rows, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    # grouped order: GROUP_M row tiles walk the columns together, so a weight tile read by one
    # is still in L2 for the next
    width = GROUP_M * tl.cdiv(N, BN)
    first = (pid // width) * GROUP_M
    size = tl.minimum(tl.cdiv(rows, BM) - first, GROUP_M)
    return first + (pid % width) % size, (pid % width) // size


@triton.jit
def _gate_up_silu_kernel(
    x_desc,  # (M, K), blocks of (BM, BK)
    xh_desc,  # the same, blocks of (BM // 2, BK): the half tiles' (x_desc where there are none)
    w_desc,  # (2N, K): gate rows [0, N), up rows [N, 2N)
    out_desc,  # (M, N), blocks of (BM, BN)
    outh_desc,  # the same, blocks of (BM // 2, BN)
    M,
    N,
    HALF_FROM,  # rows from here run as half tiles, after every whole tile
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    HALVES: tl.constexpr,  # whether any rows run as half tiles
):
    pid = tl.program_id(0)
    if HALVES:
        # programs are issued in order as SMs free up: the whole tiles first, then the half
        # tiles fill the last wave's idle SMs (gate_up_tiles.half_stripes)
        whole = tl.cdiv(HALF_FROM, BM) * tl.cdiv(N, BN)
        if pid < whole:
            pm, pn = _grouped(pid, HALF_FROM, N, BM, BN, GROUP_M)
            _tile(x_desc, w_desc, out_desc, pm * BM, pn * BN, N, K, BM, BN, BK)
        else:
            pm, pn = _grouped(pid - whole, M - HALF_FROM, N, BM // 2, BN, GROUP_M)
            _tile(xh_desc, w_desc, outh_desc, HALF_FROM + pm * (BM // 2), pn * BN, N, K,
                  BM // 2, BN, BK)  # fmt: skip
    else:
        pm, pn = _grouped(pid, M, N, BM, BN, GROUP_M)
        _tile(x_desc, w_desc, out_desc, pm * BM, pn * BN, N, K, BM, BN, BK)


@functools.cache
def _sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def fused(
    x: torch.Tensor, weight: torch.Tensor, tile: Tile, halves: int | None = None
) -> torch.Tensor:
    """The kernel itself: x (T, H) contiguous, weight (2I, H) contiguous -> (T, I). ``halves``:
    how many of the last row stripes run as half tiles (None: what gate_up_tiles.half_stripes
    picks for this GPU's SM count)."""
    m, k = x.shape
    n = weight.shape[0] // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    stripes, per_stripe = triton.cdiv(m, tile.rows), triton.cdiv(n, tile.cols)
    if halves is None:
        halves = half_stripes(m, n, tile, _sms(x.device.index or 0))
    halves = min(halves, stripes) if tile.rows >= 128 else 0
    half_from = (stripes - halves) * tile.rows
    half_tiles = triton.cdiv(m - half_from, tile.rows // 2) * per_stripe if halves else 0
    grid = ((stripes - halves) * per_stripe + half_tiles,)
    x_desc = TensorDescriptor.from_tensor(x, [tile.rows, tile.depth])
    out_desc = TensorDescriptor.from_tensor(out, [tile.rows, tile.cols])
    _gate_up_silu_kernel[grid](
        x_desc,
        TensorDescriptor.from_tensor(x, [tile.rows // 2, tile.depth]) if halves else x_desc,
        TensorDescriptor.from_tensor(weight, [tile.cols, tile.depth]),
        out_desc,
        TensorDescriptor.from_tensor(out, [tile.rows // 2, tile.cols]) if halves else out_desc,
        m,
        n,
        half_from,
        k,
        BM=tile.rows,
        BN=tile.cols,
        BK=tile.depth,
        GROUP_M=tile.group,
        HALVES=halves > 0,
        num_stages=tile.stages,
        num_warps=tile.warps,
    )
    return out


def _silu_and_mul(gate_up: torch.Tensor, flashinfer: bool) -> torch.Tensor:
    if flashinfer:
        import flashinfer as fi

        return fi.activation.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_silu_impl(x: torch.Tensor, weight: torch.Tensor, flashinfer: bool) -> torch.Tensor:
    """The fused kernel where it is faster for x's rows and fits the shape, else the pair
    (``F.linear`` and SiLU-and-mul: FlashInfer's where ``flashinfer``, else torch's)."""
    tile = tile_for(x.shape[0], captured=torch.cuda.is_current_stream_capturing())
    if (
        tile is not None
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.dtype == weight.dtype
        and x.dtype in (torch.float16, torch.bfloat16)
        and x.data_ptr() % 16 == 0  # TMA descriptors need 16-byte aligned bases
        and shape_blocker(weight.shape[1], weight.shape[0] // 2, x.element_size()) is None
    ):
        return fused(x, weight, tile)
    return _silu_and_mul(F.linear(x, weight), flashinfer)


# Under torch.compile (tc_piecewise's pieces trace with symbolic token counts) the choice by
# rows must happen at run time, inside one opaque op.
@torch.library.custom_op(OP_NAME, mutates_args=())
def gate_up_silu_op(x: torch.Tensor, weight: torch.Tensor, flashinfer: bool) -> torch.Tensor:
    return gate_up_silu_impl(x, weight, flashinfer)


@gate_up_silu_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, flashinfer: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, flashinfer: bool) -> torch.Tensor:
    """(T, H), (2I, H) -> (T, I). The op when tracing; a direct call otherwise (the dispatcher
    would add host time to every eager call)."""
    if torch.compiler.is_compiling():
        return gate_up_silu_op(x, weight, flashinfer)
    return gate_up_silu_impl(x, weight, flashinfer)
