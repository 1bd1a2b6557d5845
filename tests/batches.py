"""Prefill batches the graph-runner tests share."""

from __future__ import annotations

import random

from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode


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
