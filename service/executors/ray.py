"""Ranks as Ray actors: one per tensor-parallel rank, placed with a placement group.

Every call goes to every rank, in the same order, and is awaited with a timeout; a dead actor
surfaces as :class:`RankFailure` within a poll interval, not after the full timeout. Results
come back from rank 0 (all ranks sample the same tokens from the same gathered logits).
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from service.buckets import BucketPlan
from service.capture_result import CaptureFailure, CaptureResult, GraphSet, RankPlans
from service.commands import ForwardCommand, ForwardResult
from service.config import EngineConfig
from service.decode_sizes import DecodePlan
from service.errors import RankFailure
from service.executors.base import Executor
from service.rank_info import RankInfo
from service.ranks.actor import RankActor

log = logging.getLogger("service.ray")

POLL_S = 0.2
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PING_TIMEOUT_S = 5.0


def ensure_ray(address: str | None) -> bool:
    """Connect to Ray (a new local instance, or the given cluster); True if this call started it.

    Call it from a thread that lives as long as Ray is used (the main thread of a server): Ray
    ties the processes it starts to the life of the starting thread. A cluster address is checked
    first with a TCP connect to its GCS, since ``ray.init`` against an unreachable cluster retries
    for minutes.
    """
    import ray

    if ray.is_initialized():
        return False
    if address is None:  # a new local instance on loopback, never a recorded cluster
        ray.init(
            address="local",
            include_dashboard=False,
            log_to_driver=True,
            logging_level=logging.WARNING,
            _node_ip_address="127.0.0.1",
        )
        return True
    check_reachable(address)
    ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING)
    return True


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ``host:port`` cluster address must accept a TCP connection (its GCS port)."""
    if "://" in address or address in ("auto", "local") or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise RankFailure(
            f"the Ray cluster at {address} is not reachable ({exc}); check --ray-address"
        ) from None


def gcs_reachable(timeout_s: float = 1.0) -> bool:
    """Whether this driver's Ray GCS still accepts connections.

    A signal sent to the server's whole process group (``kill -- -PGID``, systemd's default
    ``KillMode=control-group``) also reaches the local Ray processes it started, which share the
    group; every Ray call after that blocks for a minute before Ray aborts the process. Shutdown
    asks this first and skips Ray's cleanup when the GCS is gone (its processes went with it).
    """
    import ray

    if not ray.is_initialized():
        return False
    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class RayExecutor(Executor):
    kind = "ray"

    def __init__(self, cfg: EngineConfig, actor_cls: type[RankActor] = RankActor) -> None:
        """``actor_cls`` is what each rank runs (tests pass a subclass that injects faults)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._owns_ray = ensure_ray(cfg.ray_address)
        self.cfg = cfg
        self.startup_timeout = cfg.startup_timeout_s  # load, plan, capture
        self.step_timeout = cfg.step_timeout_s  # one forward on every rank
        self._dead: str | None = None
        self._lock = threading.Lock()
        gpus = ray.cluster_resources().get("GPU", 0)
        use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and gpus >= 1)
        if use_gpu and gpus < cfg.tp:
            raise RankFailure(
                f"--tp {cfg.tp} needs {cfg.tp} GPUs but the Ray cluster has {gpus:g}; lower --tp "
                "or add GPU nodes"
            )
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        self.pg = placement_group([dict(bundle) for _ in range(cfg.tp)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=self.startup_timeout)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.pg)
            raise RankFailure(
                f"Ray could not place {cfg.tp} ranks of {bundle} within "
                f"{self.startup_timeout:.0f} s; "
                f"cluster resources: {ray.cluster_resources()}"
            ) from None
        remote = ray.remote(actor_cls)
        self.actors = [
            remote.options(
                num_cpus=1,
                num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank
                ),
                max_concurrency=2,  # ping answers while a forward runs
            ).remote(cfg, rank, cfg.tp)
            for rank in range(cfg.tp)
        ]
        where = self._get_one(self.actors[0].rendezvous.remote(cfg.ray_address is None))
        log.info("Ranks rendezvous at %s (tp %d, %s)", where, cfg.tp, bundle)
        self._infos: list[RankInfo] = self._all(lambda a: a.init.remote(where))
        self._graph_kind: str | None = None

    # ---- plumbing ----------------------------------------------------------------------------
    def _get_one(self, ref: Any) -> Any:
        return self._wait([ref], self.startup_timeout)[0]

    def _all(self, call, timeout: float | None = None) -> list:
        return self._wait([call(a) for a in self.actors], timeout or self.startup_timeout)

    def _wait(self, refs: Sequence[Any], timeout: float) -> list:
        """All results, or RankFailure as soon as any rank fails or the deadline passes."""
        import ray

        if self._dead:
            raise RankFailure(self._dead)
        deadline = time.monotonic() + timeout
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:
                    self._mark_dead(self._diagnose(refs.index(ref), exc))
                    raise RankFailure(self._dead) from exc
            if pending and time.monotonic() > deadline:
                late = [r for r, ref in enumerate(refs) if ref in pending]
                self._mark_dead(f"ranks {late} did not answer within {timeout:.0f} s")
                raise RankFailure(self._dead)
        return ray.get(list(refs))

    def _diagnose(self, rank: int, exc: BaseException) -> str:
        """Name the dead ranks first: a peer's collective error is only a symptom."""
        import ray

        refs = [a.ping.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=2.0)
        dead = []
        for r, ref in enumerate(refs):
            try:
                if ref in ready:
                    ray.get(ref)
                else:
                    dead.append(f"rank {r} does not answer")
            except Exception as err:
                dead.append(f"rank {r} died ({type(err).__name__})")
        cause = getattr(exc, "cause", None) or exc
        detail = ANSI.sub("", str(cause)).strip().splitlines()
        what = f"rank {rank} failed: {type(cause).__name__}: {detail[-1] if detail else ''}"
        return "; ".join([*dead, what])

    def _mark_dead(self, reason: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason.splitlines()[0][:500]
                log.error("Engine unhealthy: %s", self._dead)

    # ---- Executor ----------------------------------------------------------------------------
    def infos(self) -> list[RankInfo]:
        return self._infos

    def local_plans(self) -> list[RankPlans]:
        return self._all(lambda a: a.local_plans.remote())

    def build_runners(self, prefill: BucketPlan, decode: DecodePlan) -> None:
        kinds = self._all(lambda a: a.build_runners.remote(prefill, decode))
        self._graph_kind = kinds[0]

    def capture(self, kind: GraphSet, size: int) -> list[CaptureResult]:
        results = self._all(lambda a: a.capture.remote(kind, size))
        if any(isinstance(r, CaptureFailure) for r in results):
            self._all(lambda a: a.forget.remote(kind, size))  # dropped on every rank
        return results

    def execute(
        self, cmd: ForwardCommand, on_launched: Callable[[], None] | None = None
    ) -> ForwardResult:
        refs = [a.execute.remote(cmd) for a in self.actors]
        if on_launched is not None:  # the ranks work while this process waits below
            on_launched()
        return self._wait(refs, self.step_timeout)[0]

    def graph_kind(self) -> str | None:
        return self._graph_kind

    def freeze_heaps(self) -> list[int]:
        return self._all(lambda a: a.freeze_heap.remote(), self.step_timeout)

    def alive(self) -> str | None:
        import ray

        if self._dead:
            return self._dead
        refs = [a.ping.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PING_TIMEOUT_S)
        for rank, ref in enumerate(refs):
            if ref not in ready:
                self._mark_dead(f"rank {rank} did not answer a ping within {PING_TIMEOUT_S:.0f} s")
                break
            try:
                ray.get(ref)
            except Exception as exc:
                self._mark_dead(f"rank {rank} is dead: {type(exc).__name__}")
                break
        return self._dead

    def shutdown(self) -> None:
        import ray

        if not gcs_reachable():
            log.warning("Ray's GCS is gone (signalled with this server?): rank actors not stopped")
            return
        for a in self.actors:
            ray.kill(a, no_restart=True)
        ray.util.remove_placement_group(self.pg)
        if self._owns_ray:
            ray.shutdown()
