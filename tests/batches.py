"""Prefill batches and a small engine the graph-runner and kernel tests share; the kernel flags'
path from the command line to the config and to /server_info."""

from __future__ import annotations

import argparse
import random

from service.cli.args import add_engine_arguments, engine_config_from_args
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


def hit_batch(engine: Engine, lens: tuple[int, ...], bucket: int, seed: int | None = None):
    """A live prefill batch of ``lens`` on ``engine``'s worker and the replay decision for it,
    which must be a hit of ``bucket``."""
    from service.buckets import decide_replay

    batch = live_batch(engine.executor.worker, lens, seed)
    decision = decide_replay(engine.resolved.plan, sum(lens), len(lens))
    assert decision.hit and decision.bucket == bucket, decision
    return batch, decision


def engine_flags(*argv: str) -> EngineConfig:
    """The engine config the command line ``argv`` gives (argparse exits on a bad choice)."""
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return engine_config_from_args(p.parse_args(list(argv)))


def cpu_server_info() -> dict:
    """/server_info's resolved config of a small eager CPU engine (every kernel choice on its
    CPU fallback, with the reason)."""
    e = Engine(EngineConfig(device="cpu", context_length=64, kv_cache_memory_bytes=8 << 20,
                            graph=GraphConfig(backend="eager")))  # fmt: skip
    return e.resolved.to_json()
