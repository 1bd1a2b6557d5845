"""How many tokens one program of the rotary + K/V store kernel takes (a pure policy: no torch,
no triton).

A program moves ``tokens`` rows of one head (D elements each). Small batches get small blocks,
so that their few rows still spread over many programs; large ones 64 rows, so that each
program moves 16 KiB of bf16 q or k and the grid stays a few waves deep.
"""

from __future__ import annotations

SMALL_BLOCK = 16
LARGE_BLOCK = 64
LARGE_FROM = 1024  # tokens


def block_tokens(tokens: int) -> int:
    """Rows per program for a call over ``tokens`` rows (a power of two, as Triton needs)."""
    if tokens < 1:
        raise ValueError(f"a rotary call needs at least one token, got {tokens}")
    return LARGE_BLOCK if tokens >= LARGE_FROM else SMALL_BLOCK
