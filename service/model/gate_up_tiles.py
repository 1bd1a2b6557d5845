"""For which token counts the MLP's gate_up GEMM and SiLU-and-mul run as one Triton kernel, and
with which tile (a pure policy: no torch, no triton).

The fused kernel (service.model.gate_up_triton) computes silu(x Wg^T) * (x Wu^T) on the GEMM's
fp32 accumulators and writes (T, I) once; cuBLAS plus SiLU-and-mul writes (T, 2I), reads it back
and writes (T, I). Measured on the H200 against cuBLAS + FlashInfer for Qwen2.5-1.5B's gate_up
(K 1536, 2I 17920; ``benchmarks/swiglu_gemm.py``, docs/benchmarks.md, session 29), the fused
kernel takes 0.78-0.92 of the pair's time at 16-128 tokens and 0.84-0.98 from 2,048, but
1.00-1.41 between: there a tile of 128 rows by 2 x 128 columns gives 1.06-4.2 waves of 132 SMs,
and the partial last wave costs more than the saved traffic. So between ``SMALL_MAX`` and
``LARGE_MIN`` the pair runs as before. Since session 40 the kernel makes one dot twice as wide per
step; on an H100 it takes 0.79-0.89 of the pair's time from 2,048 tokens and 0.85-0.91 at 16-128
(docs/benchmarks.md, session 40). Running the last row stripes as half tiles, to fill the partial
last wave, was measured there too and was slower. Session 41 swept the sizes between with the
one-dot kernel: captured calls of 129-192, 257-384 and 1,025-2,047 rows now take it too
(``_MIDDLE``); the rest of that range keeps the pair.

The host pays more for the kernel: a Triton launch with its three tensor descriptors took 43-49
us a call against the pair's 26-39 (same script, ``--host``). Inside a captured graph that cost
is paid once, at capture; in an eager call it is paid every time, and below ``LARGE_MIN`` tokens
an eager forward is host-bound, so eager calls there keep the pair.
"""

from __future__ import annotations

from dataclasses import dataclass

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
# 3 stages and groups of 16 row tiles. With the one-dot kernel, on an H100 (the fastest of four
# alternating samples, docs/benchmarks.md session 40): 166.3 us against 171.1 for 4 stages and
# groups of 8 at 2,048 rows, 347.1 against 364.3 at 4,096, 711.2 against 734.7 at 8,192; at
# 3,072 the two tied (262.8 and 259.7). Presumably the wider groups reuse each weight tile from
# L2 across more row tiles; the sweep measured the pair of changes, not each alone.
_LARGE = Tile(128, 128, 64, 3, 8, 16)
# Captured calls between SMALL_MAX and LARGE_MIN: (fewest rows, most rows, tile), where the
# one-dot kernel beat cuBLAS + SiLU-and-mul in session 41's sweep on an H100 (docs/benchmarks.md;
# us per call in a graph, one sample of each, the kernel's best tile against the pair):
# 192 rows 30.3 against 36.3 (cuBLAS's GEMM alone took 31.6 there, more than at 256 rows), 384
# rows 39.1 against 43.8, 1,536 rows 133.6-135.4 for three 128- and 256-row tiles against 154.6.
# The pair kept 256 (38.2 against 33.1), 512 (57.4 / 52.6) and 768 rows (75.8 / 73.7); 1,024
# rows were level (97.8 / 98.2), so from 1,025 rows the large tile runs, as from 2,048.
# Session 42 confirmed it on an H100: in three alternating samples of each tile the kernel
# took 0.86-0.87 of the pair's time at 192 rows, 0.89-0.92 at 384 and 0.89-0.95 at 1,536, 1.15 at
# 256 and 0.96-1.04 at 1,024. The whole model, captured (`full` and `breakable`, two rounds), ran
# 1.8-2.3% faster at 192 tokens, 1.2-1.6% at 384 and 4.8-5.8% at 1,536 than with the pair there.
_MIDDLE = (
    (SMALL_MAX + 1, 192, Tile(64, 64, 64, 4, 4, 8)),
    (257, 384, Tile(128, 128, 64, 4, 8, 8)),
    (1025, LARGE_MIN - 1, _LARGE),
)
# the K loop takes whole steps of every tile's depth: of the largest, then
_DEPTH = max(t.depth for t in (*(t for _, t in _SMALL), *(t for *_, t in _MIDDLE), _LARGE))


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
    for low, high, tile in _MIDDLE:
        if low <= tokens <= high:
            return tile
    return None


def middle_ranges() -> tuple[tuple[int, int], ...]:
    """The captured-only row ranges between SMALL_MAX and LARGE_MIN that take the kernel."""
    return tuple((low, high) for low, high, _ in _MIDDLE)


def shape_blocker(hidden: int, intermediate: int, itemsize: int) -> str | None:
    """Why the fused kernel cannot take a gate_up of (2 * intermediate, hidden), or None.

    TMA descriptors need 16-byte aligned row strides, and the K loop takes whole steps of the
    largest tile depth."""
    if hidden % _DEPTH:
        return f"hidden size {hidden} is not a multiple of {_DEPTH}"
    if (hidden * itemsize) % 16 or (intermediate * itemsize) % 16:
        return f"rows of {hidden} or {intermediate} elements are not 16-byte aligned"
    return None
