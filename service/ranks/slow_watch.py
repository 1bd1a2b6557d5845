"""Say where a long step is while it runs: a capture that takes minutes logs, every ``every_s``
seconds, that it is still running and the innermost frames of the thread running it.

Why: a bucket's capture takes well under a second once warm, yet the first `full` capture on a
fresh H100 has taken 104-134 s (docs/benchmarks.md, sessions 37, 41 and 42), silently, with no
profile to show where. An operator watching start-up sees a line per interval instead of a
frozen log, and the next occurrence leaves the stack that explains it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

FRAMES = 8  # the innermost frames logged: enough to name the library call that waits


@contextmanager
def watch(what: str, every_s: float, log: logging.Logger) -> Iterator[None]:
    """Log ``what`` "still running after N s" with the calling thread's innermost frames every
    ``every_s`` seconds until the block exits; nothing when it finishes sooner."""
    target = threading.get_ident()
    done = threading.Event()
    t0 = time.monotonic()

    def run() -> None:
        while not done.wait(every_s):
            frame = sys._current_frames().get(target)
            stack = "".join(traceback.format_stack(frame)[-FRAMES:]) if frame else "(gone)\n"
            log.warning(
                "%s still running after %.1f s; innermost frames:\n%s",
                what,
                time.monotonic() - t0,
                stack.rstrip(),
            )

    watcher = threading.Thread(target=run, name=f"watch {what}", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=every_s + 1.0)
