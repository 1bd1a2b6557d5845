"""Prefill batches and a small engine the graph-runner and kernel tests share."""

from __future__ import annotations

import random

from service.config import EngineConfig, GraphConfig
from service.engine import Engine
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode


def small_engine(backend: str, device: str, **kw) -> Engine:
    """The built-in model (unless ``kw`` names one) with buckets 64 and 256: float32 on CPU,
    bf16 on CUDA; ``kw``: more EngineConfig fields (the kernel choices under test)."""
    return Engine(
        EngineConfig(device=device, dtype="bfloat16" if device == "cuda" else "float32",
                     context_length=512, max_running_requests=8, chunked_prefill_size=256,
                     kv_cache_memory_bytes=32 << 20,
                     graph=GraphConfig(backend=backend, buckets=(64, 256)), **kw),
    )  # fmt: skip


def live_batch(worker, lens: tuple[int, ...], seed: int | None = None) -> ForwardBatch:
    """A prefill batch of fresh requests in rows 0.., KV slots from 1, random ids."""
    rng = random.Random(seed)
    slots = list(range(1, 1 + sum(lens)))
    start = 0
    for row, n in enumerate(lens):
        worker.req_to_token.write(row, 0, slots[start : start + n])
        start += n
    layout = BatchLayout(ForwardMode.EXTEND, tuple(range(len(lens))), (0,) * len(lens), lens)
    ids = [rng.randrange(384) for _ in range(sum(lens))]
    return ForwardBatch.build(layout, ids, slots, worker.device)
