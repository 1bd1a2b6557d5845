"""How many tokens one program of the rotary + K/V store kernel takes (a pure policy: no torch,
no triton).

A program moves ``tokens`` rows of one head (D elements each). 16 rows a program was the
fastest block measured at every size on the H200 (16 to 8,192 tokens, blocks of 16 to 128;
docs/benchmarks.md, session 32: at 2,048 tokens 4.96 us against 5.77 with 64 rows, at 8,192
18.6 against 20.8): the kernel is a copy with a little arithmetic, and more, smaller programs
keep more loads in flight than fewer, wider ones.
"""

from __future__ import annotations

BLOCK = 16


def block_tokens(tokens: int) -> int:
    """Rows per program for a call over ``tokens`` rows (a power of two, as Triton needs)."""
    if tokens < 1:
        raise ValueError(f"a rotary call needs at least one token, got {tokens}")
    return BLOCK


def bias_in_rope(tokens: int) -> bool:
    """Whether the kernel adds qkv's bias over ``tokens`` rows, the GEMM then running without
    its bias epilogue (service.model.llama.Attention.qkv): yes, at every size.

    Why: session 50's H200 profile has cuBLAS run qkv's GEMM with the bias epilogue as 64 x 64
    tiles at 256 tokens, 6.5 us a layer against 2.1 us of FLOPs, and the kernel loads every
    element of q, k and v anyway. Measured on an H100 (docs/benchmarks.md, session 52): the GEMM
    without the epilogue is 0.02-0.72 us faster from 1 to 8,192 tokens, the kernel with the bias
    0.1-0.2 us slower (2.8 at 8,192); the pair in one graph 0.98-1.02x of today's. The whole model
    (Qwen2.5-1.5B shapes, ``benchmarks/schedule_ab.py --tweak bias_in_rope``, two processes) ran
    0.1-0.9% faster with the fold in 11 of 12 backend x bucket figures at 16, 256 and 2,048 tokens
    (the twelfth 0.4% slower). Each difference is inside one figure's spread (its 40 samples
    span about 5%), but the sign held in both processes; with q, k and v rounded once instead
    of twice, the fold is the better default. ``--tweak bias_in_gemm`` measures it from the
    other side. No size is refused: the kernel's launcher returns at once on zero rows."""
    return True
