"""Start-up's objects out of the garbage collector's reach, in every process that serves steps.

Everything start-up creates (imported modules, the model, the captured graphs' Python objects)
lives as long as the engine. Left in the collector's generations, the first full collection
after start-up scans them all (~320k objects, ~200 ms on a 2-core CI machine) and lands on
whichever request is running; every later full collection scans them again. Collecting once and
freezing them (``gc.freeze``) when start-up is done removes both. vLLM freezes its heap after
warm-up; SGLang has a freeze for the same reason. ``gc.unfreeze`` undoes it before a rebuild,
when the old engine's objects become garbage.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_start_up_heap(where: str) -> int:
    """Collect, then freeze what is left; returns how many objects are frozen."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(
        "Garbage collector (%s): %d start-up objects frozen after a %.0f ms collection",
        where,
        frozen,
        (time.perf_counter() - start) * 1e3,
    )
    return frozen
