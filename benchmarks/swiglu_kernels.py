"""The other forms of the fused gate_up GEMM + SiLU-and-mul that ``swiglu_gemm.py`` measures
against the service's kernel (service.model.gate_up_triton): pointer loads, a persistent grid
(with or without warp specialization), one dot on an interleaved weight, and the two-dot form the
service ran until session 40. Prototypes, none faster on the H200 (docs/benchmarks.md, session
29); module-level so that Triton resolves the helpers they share."""

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
def _two_dots(xd, wd, pm, pn, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr):  # fmt: skip
    # a gate load and dot, then an up load and dot, per step of K: (BM, BN) gate and up sums
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = xd.load([pm * BM, k])
        acc_g = tl.dot(a, wd.load([pn * BN, k]).T, acc_g)
        acc_u = tl.dot(a, wd.load([N + pn * BN, k]).T, acc_u)
    return acc_g, acc_u


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
        acc_g, acc_u = _two_dots(xd, wd, pm, pn, N, K, BM, BN, BK)
        y = acc_g * tl.sigmoid(acc_g) * acc_u
        od.store([pm * BM, pn * BN], y.to(od.dtype))


def _descriptors(x, w, out, bm, bn, bk, w_rows):
    """(M, N, K, x, weight and out descriptors); ``w_rows`` rows of the weight per load."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    descs = (
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(w, [w_rows, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]),
    )
    return m, w.shape[0] // 2, k, *descs


def make_tma_persistent(x, w, out, bm, bn, bk, stages, warps, group, ws=False):
    m, n, k, xd, wd, od = _descriptors(x, w, out, bm, bn, bk, bn)
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
def fused_tma_alt(
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
    INTERLEAVED: tl.constexpr,
):
    pm, pn = _tile(M, N, BM, BN, GROUP_M)
    if INTERLEAVED:
        # wd holds the weight reordered: BN gate rows, then the same BN up rows, and so on, so
        # one (2 BN)-wide dot per step computes both halves of a tile
        acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
        for k in range(0, K, BK):
            acc = tl.dot(xd.load([pm * BM, k]), wd.load([pn * 2 * BN, k]).T, acc)
        g, u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
    else:
        # the service's kernel before session 40
        g, u = _two_dots(xd, wd, pm, pn, N, K, BM, BN, BK)
    y = g * tl.sigmoid(g) * u
    od.store([pm * BM, pn * BN], y.to(od.dtype))


def _make_alt(x, w, out, bm, bn, bk, stages, warps, group, interleaved):
    m, n, k, xd, wd, od = _descriptors(x, w, out, bm, bn, bk, 2 * bn if interleaved else bn)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)

    def run():
        fused_tma_alt[grid](
            xd, wd, od, m, n, k, BM=bm, BN=bn, BK=bk, GROUP_M=group, INTERLEAVED=interleaved,
            num_stages=stages, num_warps=warps,
        )  # fmt: skip
        return out

    return run


def make_tma_one(x, w, out, bm, bn, bk, stages, warps, group):
    """The one-dot form; reorders a copy of ``w`` (N must be a multiple of ``bn``)."""
    n, k = w.shape[0] // 2, w.shape[1]
    w2 = w.view(2, n // bn, bn, k).transpose(0, 1).reshape(2 * n, k).contiguous()
    return _make_alt(x, w2, out, bm, bn, bk, stages, warps, group, True)


def make_tma_two(x, w, out, bm, bn, bk, stages, warps, group):
    """The two-dot form (two loads of BN weight rows per step)."""
    return _make_alt(x, w, out, bm, bn, bk, stages, warps, group, False)


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
    """The service's kernel (service.model.gate_up_triton.fused) at this tile."""
    from service.model.gate_up_tiles import Tile
    from service.model.gate_up_triton import fused

    tile = Tile(bm, bn, bk, stages, warps, group)
    return lambda: fused(x, w, tile)
