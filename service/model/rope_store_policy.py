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
    """Whether the kernel adds qkv's bias over ``tokens`` rows, the GEMM running without it
    (measurement pending)."""
    return tokens >= 1
