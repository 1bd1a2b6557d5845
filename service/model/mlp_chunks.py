"""How many tokens the MLP takes at once (a pure policy: no torch).

Why chunk at all: the MLP's intermediate activations are the largest tensors of a forward, and a
captured graph's memory pool keeps its peak for good. Without the fused gate_up kernel cuBLAS
writes (T, 2I), SiLU-and-mul reads it and writes (T, I): 3 x I x 2 bytes a token in bf16, 440 MB
at 8,192 tokens of Qwen2.5-1.5B (I = 8,960).

Why not in small chunks: a chunk's GEMMs end in a partial wave of output tiles, and every chunk
pays that tail again. On an H100 at 8,192 tokens (docs/benchmarks.md, session 42) the gate_up
kernel in four chunks of 2,048 rows took 23.3 ms a forward against 22.1 ms as one call of 8,192
(``tc_piecewise``, which runs the MLP whole), and down 9.6 ms in chunks against about 9.2 whole; the
chunks' outputs were then joined by a copy (``torch.cat``, 0.42 ms). So a chunk is as large as
``BUDGET_BYTES`` of intermediates allows, the chunks are equal up to a row tile (no short last
chunk with a tail of its own), and each chunk's output is written into its rows of one output (no
join).
"""

from __future__ import annotations

# the intermediates one chunk may hold: 256 MiB; Qwen2.5-1.5B runs 4,096 tokens whole and 8,192 as
# two chunks of 4,096, where 2,048-token chunks held 110 MB
BUDGET_BYTES = 256 * 2**20
ROW_ALIGN = 128  # chunk starts on a GEMM's row tile


def chunk_rows(rows: int, intermediate: int, dtype_bytes: int, budget: int = BUDGET_BYTES) -> int:
    """Tokens per MLP chunk for ``rows`` tokens and ``intermediate`` (this rank's I) columns:
    ``rows`` itself when the intermediates fit ``budget`` (an empty call too: the whole path,
    as before chunks were sized), else the equal share of the fewest
    chunks that fit, rounded up to ``ROW_ALIGN`` rows (so a chunk may exceed the budget by under
    ``ROW_ALIGN`` rows' worth)."""
    if rows < 0 or intermediate <= 0 or dtype_bytes <= 0:
        raise ValueError(
            f"rows {rows} must not be negative, intermediate {intermediate} and dtype_bytes "
            f"{dtype_bytes} must be positive"
        )
    fit = max(1, budget // (3 * intermediate * dtype_bytes))
    if rows <= fit:
        return rows
    chunks = -(-rows // fit)
    share = -(-rows // chunks)
    return min(rows, -(-share // ROW_ALIGN) * ROW_ALIGN)
