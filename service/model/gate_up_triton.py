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

import torch
import triton
import triton.language as tl
from torch.nn import functional as F
from triton.tools.tensor_descriptor import TensorDescriptor

from service.model.gate_up_tiles import Tile, shape_blocker, tile_for

OP_NAME = "capture_service::gate_up_silu"


@triton.jit
def _gate_up_silu_kernel(
    x_desc,  # (M, K)
    w_desc,  # (2, N, K): the (2N, K) weight as its gate plane and its up plane
    out_desc,  # (M, N)
    M,
    N,
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # grouped order: GROUP_M row tiles walk the columns together, so a weight tile read by one
    # is still in L2 for the next
    pid = tl.program_id(0)
    width = GROUP_M * tl.cdiv(N, BN)
    first = (pid // width) * GROUP_M
    size = tl.minimum(tl.cdiv(M, BM) - first, GROUP_M)
    pm = first + (pid % width) % size
    pn = (pid % width) // size
    acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
    for k in range(0, K, BK):
        # one load brings BN gate rows and the same BN up rows, (2, BN, BK), which lie in
        # shared memory as (2 BN, BK): one dot twice as wide per step instead of two (on an H100
        # 5.9% less time at 2,048 tokens and 5.6% at 8,192, the same at 3,072 and at 16-128;
        # docs/benchmarks.md session 40). Rows past N in either plane read zeros, and the store
        # clips their columns.
        b = tl.reshape(w_desc.load([0, pn * BN, k]), (2 * BN, BK))
        acc = tl.dot(x_desc.load([pm * BM, k]), b.T, acc)
    # (BM, 2 BN): gate's BN columns, then up's
    gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
    y = gate * tl.sigmoid(gate) * up
    out_desc.store([pm * BM, pn * BN], y.to(out_desc.dtype))


def fused(x: torch.Tensor, weight: torch.Tensor, tile: Tile) -> torch.Tensor:
    """The kernel itself: x (T, H) contiguous, weight (2I, H) contiguous -> (T, I)."""
    m, k = x.shape
    n = weight.shape[0] // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, tile.rows) * triton.cdiv(n, tile.cols),)
    _gate_up_silu_kernel[grid](
        TensorDescriptor.from_tensor(x, [tile.rows, tile.depth]),
        TensorDescriptor(weight, [2, n, k], [n * k, k, 1], [2, tile.cols, tile.depth]),
        TensorDescriptor.from_tensor(out, [tile.rows, tile.cols]),
        m,
        n,
        k,
        BM=tile.rows,
        BN=tile.cols,
        BK=tile.depth,
        GROUP_M=tile.group,
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
