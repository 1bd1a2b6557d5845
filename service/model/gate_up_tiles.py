"""For which token counts the MLP's gate_up GEMM and SiLU-and-mul run as one Triton kernel, and
with which tile (a pure policy: no torch, no triton).

The fused kernel (service.model.gate_up_triton) computes silu(x Wg^T) * (x Wu^T) on the GEMM's
fp32 accumulators and writes (T, I) once; cuBLAS plus SiLU-and-mul writes (T, 2I), reads it back
and writes (T, I). Measured on the H200 against cuBLAS + FlashInfer for Qwen2.5-1.5B's gate_up
(K 1536, 2I 17920; ``benchmarks/swiglu_gemm.py``, docs/benchmarks.md, session 29), the fused
kernel takes 0.78-0.92 of the pair's time at 16-128 tokens and 0.84-0.98 from 2,048, but
1.00-1.41 between: there a tile of 128 rows by 2 x 128 columns gives 1.06-4.2 waves of 132 SMs,
and the partial last wave costs more than the saved traffic. So between ``SMALL_MAX`` and
``LARGE_MIN`` the pair runs as before.

The host pays more for the kernel: a Triton launch with its three tensor descriptors took 43-49
us a call against the pair's 26-39 (same script, ``--host``). Inside a captured graph that cost
is paid once, at capture; in an eager call it is paid every time, and below ``LARGE_MIN`` tokens
an eager forward is host-bound, so eager calls there keep the pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

SMALL_MAX = 128  # the fused kernel up to this many tokens ...
LARGE_MIN = 2048  # ... and from this many


@dataclass(frozen=True)
class Tile:
    """One program's share: ``rows`` tokens by ``cols`` output columns (each needs ``cols`` gate
    and ``cols`` up columns of the GEMM), ``depth`` of K per step; Triton launch parameters."""

    rows: int
    cols: int
    depth: int
    stages: int
    warps: int
    group: int  # row tiles that walk the columns together (weight tiles reused from L2)


# the fastest measured configuration per size class (swiglu_gemm.py's sweep, two H200 runs)
_SMALL = (
    (16, Tile(16, 128, 128, 3, 4, 1)),
    (32, Tile(32, 64, 128, 3, 4, 1)),
    (64, Tile(64, 64, 64, 4, 4, 1)),
    (128, Tile(128, 128, 64, 4, 8, 8)),
)
_LARGE = Tile(128, 128, 64, 4, 8, 8)
# the K loop takes whole steps of every tile's depth: of the largest, then
_DEPTH = max(t.depth for t in (*(t for _, t in _SMALL), _LARGE))


def tile_for(tokens: int, captured: bool = True) -> Tile | None:
    """The fused kernel's tile for ``tokens`` rows, or None where cuBLAS + SiLU-and-mul is
    faster (or there are no rows). ``captured``: the call is being captured into a CUDA graph;
    an eager call takes the kernel only where the device, not the host, sets the pace."""
    if tokens <= 0:
        return None
    if tokens >= LARGE_MIN:
        return _LARGE
    if not captured:
        return None
    for limit, tile in _SMALL:
        if tokens <= limit:
            return tile
    return None


# A tile of half the rows (the same columns and warps) costs about this share of a whole tile's
# time: the weight tiles it streams are the same, only x's and the accumulators halve.
# Estimated from swiglu_gemm.py's ``--half-tails`` sweep (docs/benchmarks.md, session 38).
HALF_COST = 0.6
MAX_HALF_STRIPES = 4  # a tail longer than this would pay the half tiles' lower efficiency


def makespan(whole: int, half: int, sms: int, half_cost: float = HALF_COST) -> float:
    """The time, in whole-tile units, for ``sms`` SMs to run ``whole`` tiles and then ``half``
    half tiles, one program per SM at a time (a tile's shared memory leaves room for no second),
    each program going to the first SM free: the hardware issues programs in order as SMs free
    up, and every tile of one kind takes the same time."""
    if sms <= 0:
        raise ValueError(f"sms must be positive, got {sms}")
    waves, rest = divmod(whole, sms)
    end = float(waves + (rest > 0))
    if half <= 0:
        return end
    # ``sms - rest`` SMs are free at ``waves``, ``rest`` more at ``waves + 1``; identical tiles
    # placed greedily start at the earliest free slots, so the last one starts at the half-th
    early, late = sms - rest, rest
    slots = [(waves + k * half_cost, early) for k in range(-(-half // early))]
    if late:
        slots += [(waves + 1 + k * half_cost, late) for k in range(-(-half // late))]
    placed = 0
    for start, count in sorted(slots):
        placed += count
        if placed >= half:
            return max(end, start + half_cost)
    raise AssertionError("unreachable: the slots hold every half tile")


@lru_cache(maxsize=256)
def half_stripes(tokens: int, cols: int, tile: Tile, sms: int, half_cost: float = HALF_COST) -> int:
    """How many of the last row stripes (``tile.rows`` tokens each) run as twice as many stripes
    of half the rows, for ``tokens`` rows and ``cols`` output columns on ``sms`` SMs: the count
    whose makespan is shortest, 0 where none is shorter than the whole tiles' partial last wave.

    At 2,048 tokens of Qwen2.5-1.5B (8,960 columns: 70 column tiles of 128) whole tiles make
    1,120 programs, 8.48 waves of 132 SMs, so the ninth wave runs half empty; with the last
    stripe as 140 half tiles the grid ends after about 8.6 waves."""
    if tokens <= 0 or cols <= 0 or tile.rows < 128:  # wgmma's M is 64 per warpgroup
        return 0
    stripes = -(-tokens // tile.rows)
    per_stripe = -(-cols // tile.cols)
    best, best_t = 0, makespan(stripes * per_stripe, 0, sms, half_cost)
    for s in range(1, min(stripes, MAX_HALF_STRIPES) + 1):
        # the last stripe may be partial: its half stripes are only those holding rows
        half_rows = tokens - (stripes - s) * tile.rows
        half = -(-half_rows // (tile.rows // 2)) * per_stripe
        t = makespan((stripes - s) * per_stripe, half, sms, half_cost)
        if t < best_t - 1e-9:
            best, best_t = s, t
    return best


def shape_blocker(hidden: int, intermediate: int, itemsize: int) -> str | None:
    """Why the fused kernel cannot take a gate_up of (2 * intermediate, hidden), or None.

    TMA descriptors need 16-byte aligned row strides, and the K loop takes whole steps of the
    largest tile depth."""
    if hidden % _DEPTH:
        return f"hidden size {hidden} is not a multiple of {_DEPTH}"
    if (hidden * itemsize) % 16 or (intermediate * itemsize) % 16:
        return f"rows of {hidden} or {intermediate} elements are not 16-byte aligned"
    return None
