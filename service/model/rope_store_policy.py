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
    its bias epilogue (service.model.llama.Attention.qkv).

    Why it might pay: at 256 tokens cuBLAS runs qkv's GEMM with the bias epilogue as 64 x 64
    tiles, 6.5 us a layer on the H200 against 2.1 us of FLOPs (docs/benchmarks.md, session 50's
    profile), and the kernel loads every element of q, k and v anyway. Not measured yet
    (``benchmarks/qkv_bias.py``, session 51 got no GPU): until it is, the GEMM keeps the bias."""
    return False
