"""Starting Ray for a server so that a signal during Ray's start leaves nothing behind.

``ray.init`` installs its own SIGTERM handlers while it starts a local instance: first one that
raises ``SystemExit(15)``, then, once its node exists, one that kills the processes the node
started and raises ``SystemExit(1)``. Either way the agents the raylet spawns (the dashboard
agent, the runtime-env agent) outlive it (Ray 2.60: on this project's CPU machine a SIGTERM
two seconds into ``serve`` left four of them running for good). An orchestrator that deletes a
pod while it starts, or an operator's Ctrl-C, must not leak them. So the server is a child
subreaper while Ray starts (orphans of its children come back to it, not to init); on a signal
it stops Ray, ends every child and orphan it holds, and the caller exits 0, as a drain does.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from service.executors.ray import ensure_ray

log = logging.getLogger("service.ray")

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
RAY_SHUTDOWN_TIMEOUT_S = 5.0
END_TIMEOUT_S = 5.0


class RayStartInterrupted(Exception):
    """A signal arrived while Ray was starting; what it had started is gone."""


def set_child_subreaper(on: bool) -> bool:
    """Make orphaned descendants of this process its children (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def end_children(timeout_s: float = END_TIMEOUT_S) -> int:
    """SIGTERM every child of this process, SIGKILL those alive after ``timeout_s``, reap them;
    again while ending them hands this subreaper more orphans. Returns how many were ended."""
    import psutil

    me = psutil.Process()
    ended: set[int] = set()
    for _ in range(5):  # each round can orphan one more generation onto this process
        children = [c for c in me.children() if c.pid not in ended]
        if not children:
            break
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.terminate()
        _, alive = psutil.wait_procs(children, timeout=timeout_s)
        for child in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        psutil.wait_procs(alive, timeout=timeout_s)
        ended.update(c.pid for c in children)
    return len(ended)


def _shutdown_ray(timeout_s: float) -> None:
    """``ray.shutdown()`` bounded: after an interrupted start it may wait on a GCS that never
    came up."""

    def shutdown() -> None:
        try:
            import ray

            ray.shutdown()
        except Exception as exc:  # the processes are ended below anyway
            log.warning("ray.shutdown() after the interrupted start failed: %s", exc)

    worker = threading.Thread(target=shutdown, name="ray-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        log.warning("ray.shutdown() did not return in %g s; ending Ray's processes", timeout_s)


def stop_started_ray() -> int:
    """Stop Ray (bounded) and end every child process left; returns how many were ended."""
    _shutdown_ray(RAY_SHUTDOWN_TIMEOUT_S)
    return end_children()


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(signum)


@dataclass(frozen=True)
class RayStarted:
    ray_sigterm_handler: Any  # the handler ray.init left (it stops the node's processes)

    def hand_over(self) -> None:
        """Put Ray's SIGTERM handler back, right before the server installs its own: the server
        keeps the handler it finds and restores it when it stops, so that a signal during its
        shutdown reaches Ray's, as it did before this guard."""
        signal.signal(signal.SIGTERM, self.ray_sigterm_handler)


def start_ray(address: str | None) -> RayStarted:
    """:func:`ensure_ray` from the main thread; a SIGTERM or SIGINT during it stops whatever Ray
    had started and raises :class:`RayStartInterrupted`. On return SIGTERM raises
    ``SystemExit`` (SIGINT raises ``KeyboardInterrupt``) until the caller calls
    :meth:`RayStarted.hand_over`; the caller stops Ray with :func:`stop_started_ray` if one
    arrives before then."""
    subreaper = set_child_subreaper(True)
    t0 = time.monotonic()
    # until ray.init installs its own handler: a SIGTERM while Ray is imported takes the same
    # path as one during its start, not the default action's exit 143
    signal.signal(signal.SIGTERM, _raise_exit)
    try:
        ensure_ray(address)
        # Ray's node handler (it leaves the agents behind) is replaced again until the hand-over:
        # a signal before the server's own handlers are in raises SystemExit for the caller to
        # stop Ray cleanly
        return RayStarted(signal.signal(signal.SIGTERM, _raise_exit))
    except (SystemExit, KeyboardInterrupt) as exc:
        # a second signal from here on ends the process at once, as during a drain
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        what = "SIGINT" if isinstance(exc, KeyboardInterrupt) else f"SystemExit({exc.code})"
        log.warning(
            "Ray's start was interrupted after %.1f s (%s): stopping what Ray started",
            time.monotonic() - t0, what,
        )  # fmt: skip
        ended = stop_started_ray()
        raise RayStartInterrupted(
            f"start-up interrupted by a signal while Ray was starting; ended {ended} of its "
            "processes"
        ) from None
    finally:
        if subreaper:
            set_child_subreaper(False)
