"""A capture that runs long says so while it runs, with where it is; a quick one says nothing."""

from __future__ import annotations

import logging
import time

from service.ranks.runners.breakable import BreakableGraphRunner
from service.ranks.slow_watch import watch
from service.ranks.worker import RankWorker
from tests.batches import small_engine

log = logging.getLogger("test.slow_watch")


def a_step_that_waits(seconds: float) -> None:
    time.sleep(seconds)


def test_a_long_block_is_reported_with_its_innermost_frames_until_it_ends(caplog):
    caplog.set_level(logging.WARNING, logger=log.name)
    with watch("the step", 0.05, log):
        a_step_that_waits(0.3)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) >= 3, lines  # one per interval while it ran
    assert all(m.startswith("the step still running after ") for m in lines)
    assert all("a_step_that_waits" in m and "time.sleep" in m for m in lines)
    time.sleep(0.2)  # the watcher stopped with the block: nothing more
    assert len(caplog.records) == len(lines)


def test_a_quick_block_says_nothing(caplog):
    caplog.set_level(logging.WARNING, logger=log.name)
    with watch("the step", 0.5, log):
        a_step_that_waits(0.01)
    time.sleep(0.6)
    assert caplog.records == []


def test_a_slow_start_up_capture_names_rank_bucket_and_the_waiting_call(caplog, monkeypatch):
    """The engine's own start-up path: a bucket whose capture waits (here a sleep inside the
    runner) logs the rank, the bucket and the frame it waits in, and start-up still finishes
    with every bucket captured."""
    real = BreakableGraphRunner.capture_bucket

    def slow_capture(self, size):
        if size == 256:
            a_step_that_waits(0.35)
        return real(self, size)

    monkeypatch.setattr(BreakableGraphRunner, "capture_bucket", slow_capture)
    monkeypatch.setattr(RankWorker, "capture_watch_s", 0.1)
    caplog.set_level(logging.WARNING, logger="service.ranks.worker")
    engine = small_engine("breakable", "cpu")
    try:
        assert engine.resolved.plan.bucket_sizes == (64, 256)
    finally:
        engine.shutdown()
    want = "rank 0: capture of prefill size 256 still running after"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(want)]
    assert lines, "no progress line while the capture waited"
    assert "a_step_that_waits" in lines[0]
