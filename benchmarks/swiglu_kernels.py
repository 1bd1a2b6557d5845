"""The fused gate_up GEMM + SiLU-and-mul Triton kernels measured by ``swiglu_gemm.py``
(prototype; module-level so that Triton resolves the helper they share)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tile(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    return _tile_of(tl.program_id(0), M, N, BM, BN, GROUP_M)


@triton.jit
def _tile_of(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    # grouped order: GROUP_M row tiles walk the columns together, so their weight tiles are
    # read from L2 instead of memory
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    width = GROUP_M * n_n
    first = (pid // width) * GROUP_M
    size = tl.minimum(n_m - first, GROUP_M)
    return first + (pid % width) % size, (pid % width) // size


@triton.jit
def fused_ptr(
    x,
    w,
    out,
    M,
    N,
    K: tl.constexpr,
    sxm,
    swn,
    som,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # x (M, K), w (2N, K): rows [0, N) gate, [N, 2N) up; out (M, N) = silu(x g^T) * (x u^T)
    pm, pn = _tile(M, N, BM, BN, GROUP_M)
    rm = (pm * BM + tl.arange(0, BM)) % M  # wrapped rows/columns load valid memory; the
    rn = (pn * BN + tl.arange(0, BN)) % N  # store below is masked
    rk = tl.arange(0, BK)
    xp = x + rm[:, None] * sxm + rk[None, :]
    gp = w + rn[None, :] * swn + rk[:, None]
    up = gp + N * swn
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        a = tl.load(xp)
        acc_g = tl.dot(a, tl.load(gp), acc_g)
        acc_u = tl.dot(a, tl.load(up), acc_u)
        xp += BK
        gp += BK
        up += BK
    y = acc_g * tl.sigmoid(acc_g) * acc_u
    om = pm * BM + tl.arange(0, BM)
    on = pn * BN + tl.arange(0, BN)
    mask = (om[:, None] < M) & (on[None, :] < N)
    tl.store(out + om[:, None] * som + on[None, :], y.to(out.dtype.element_ty), mask=mask)


@triton.jit
def fused_tma(
    xd,
    wd,
    od,
    M,
    N,
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pm, pn = _tile(M, N, BM, BN, GROUP_M)
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = xd.load([pm * BM, k])
        acc_g = tl.dot(a, wd.load([pn * BN, k]).T, acc_g)
        acc_u = tl.dot(a, wd.load([N + pn * BN, k]).T, acc_u)
    y = acc_g * tl.sigmoid(acc_g) * acc_u
    od.store([pm * BM, pn * BN], y.to(od.dtype))


@triton.jit
def fused_tma_persistent(
    xd,
    wd,
    od,
    M,
    N,
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    SMS: tl.constexpr,
    WS: tl.constexpr,
):
    # one program per SM walks the tiles: the next tile's loads overlap this tile's epilogue
    tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles, SMS, flatten=True, warp_specialize=WS):
        pm, pn = _tile_of(tile, M, N, BM, BN, GROUP_M)
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = xd.load([pm * BM, k])
            acc_g = tl.dot(a, wd.load([pn * BN, k]).T, acc_g)
            acc_u = tl.dot(a, wd.load([N + pn * BN, k]).T, acc_u)
        y = acc_g * tl.sigmoid(acc_g) * acc_u
        od.store([pm * BM, pn * BN], y.to(od.dtype))


def make_tma_persistent(x, w, out, bm, bn, bk, stages, warps, group, ws=False):
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = w.shape[0] // 2
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w, [bn, bk])
    od = TensorDescriptor.from_tensor(out, [bm, bn])
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = (min(sms, triton.cdiv(m, bm) * triton.cdiv(n, bn)),)

    def run():
        fused_tma_persistent[grid](
            xd, wd, od, m, n, k, BM=bm, BN=bn, BK=bk, GROUP_M=group, SMS=sms, WS=ws,
            num_stages=stages, num_warps=warps,
        )  # fmt: skip
        return out

    return run


@triton.jit
def fused_tma_one(
    xd,
    wd,
    od,
    M,
    N,
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # wd holds the weight reordered: BN gate rows, then the same BN up rows, and so on, so one
    # (2 BN)-wide dot per step computes both halves of a tile
    pm, pn = _tile(M, N, BM, BN, GROUP_M)
    acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
    for k in range(0, K, BK):
        acc = tl.dot(xd.load([pm * BM, k]), wd.load([pn * 2 * BN, k]).T, acc)
    g, u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
    y = g * tl.sigmoid(g) * u
    od.store([pm * BM, pn * BN], y.to(od.dtype))


def make_tma_one(x, w, out, bm, bn, bk, stages, warps, group):
    """The one-dot form; reorders a copy of ``w`` (N must be a multiple of ``bn``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = w.shape[0] // 2
    w2 = w.view(2, n // bn, bn, k).transpose(0, 1).reshape(2 * n, k).contiguous()
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w2, [2 * bn, bk])
    od = TensorDescriptor.from_tensor(out, [bm, bn])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)

    def run():
        fused_tma_one[grid](
            xd, wd, od, m, n, k, BM=bm, BN=bn, BK=bk, GROUP_M=group,
            num_stages=stages, num_warps=warps,
        )  # fmt: skip
        return out

    return run


def run_ptr(x, w, out, bm, bn, bk, stages, warps, group):
    m, k = x.shape
    n = w.shape[0] // 2
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    fused_ptr[grid](
        x,
        w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        BM=bm,
        BN=bn,
        BK=bk,
        GROUP_M=group,
        num_stages=stages,
        num_warps=warps,
    )
    return out


def make_tma(x, w, out, bm, bn, bk, stages, warps, group):
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = w.shape[0] // 2
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w, [bn, bk])
    od = TensorDescriptor.from_tensor(out, [bm, bn])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)

    def run():
        fused_tma[grid](
            xd,
            wd,
            od,
            m,
            n,
            k,
            BM=bm,
            BN=bn,
            BK=bk,
            GROUP_M=group,
            num_stages=stages,
            num_warps=warps,
        )
        return out

    return run
