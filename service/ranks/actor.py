"""The body of one rank's Ray actor: process-group set-up around a :class:`RankWorker`.

Each actor joins two groups on a port chosen at start-up by rank 0: the tensor-parallel group
(NCCL on CUDA, gloo on CPU) used inside the model, and a gloo CPU group used for control
barriers, which have timeouts on both devices (``monitored_barrier``).
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from datetime import timedelta

from service.buckets import BucketPlan
from service.capture_result import CaptureResult, GraphSet, RankPlans
from service.commands import ForwardCommand, ForwardResult
from service.config import EngineConfig
from service.decode_sizes import DecodePlan
from service.rank_info import RankInfo


class RankActor:
    def __init__(self, cfg: EngineConfig, rank: int, world_size: int) -> None:
        from service.logs import setup_logging

        setup_logging(logging.INFO, rank=rank)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.worker = None
        self.control = None

    # ---- set-up ------------------------------------------------------------------------------
    def rendezvous(self, local: bool) -> str:
        """Where the ranks' process groups meet (rank 0 chooses, every rank joins).

        A local Ray instance keeps everything on this machine and off the network: a file store
        in a fresh private folder (a TCP store would listen on every interface), and gloo's
        connections on loopback. On a cluster, a free TCP port of this node.
        """
        if local:
            folder = tempfile.mkdtemp(prefix="capture-service-rendezvous-")
            return "file://" + os.path.join(folder, "store")
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def rank_config(self) -> EngineConfig:
        """The configuration this rank starts from (the engine's)."""
        return self.cfg

    def init(self, init_method: str) -> RankInfo:
        if init_method.startswith("file://"):  # a local instance: gloo on loopback too
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        import torch
        import torch.distributed as dist

        from service.model.parallel import TPGroup
        from service.ranks.startup import set_up_rank
        from service.ranks.worker import RankWorker

        use_cuda = self.cfg.device != "cpu" and torch.cuda.is_available()
        if not use_cuda:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
        timeout = timedelta(seconds=self.cfg.collective_timeout_s)
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
            device_id=torch.device("cuda", 0) if use_cuda else None,
        )
        # control barriers wait as long as start-up may take: a peer may be compiling, or stuck
        # in a collective until the collective timeout (which must then come back first)
        startup = timedelta(seconds=self.cfg.startup_timeout_s)
        self.control = dist.new_group(backend="gloo", timeout=startup)
        tp = TPGroup(self.rank, self.world_size, dist.group.WORLD)
        self.worker = RankWorker(set_up_rank(self.rank_config(), tp, local_gpu=0))
        return self.worker.info

    def barrier(self) -> None:
        """Wait for every rank, at most the start-up budget (a slow rank may be compiling)."""
        import torch.distributed as dist

        dist.monitored_barrier(self.control, timeout=timedelta(seconds=self.cfg.startup_timeout_s))

    # ---- start-up commands -------------------------------------------------------------------
    def local_plans(self) -> RankPlans:
        return self.worker.resolve_local_plans()

    def build_runners(self, prefill: BucketPlan, decode: DecodePlan) -> str | None:
        self.worker.build_runners(prefill, decode)
        return self.worker.graph_kind

    def capture(self, kind: GraphSet, size: int) -> CaptureResult:
        self.barrier()  # every rank enters the capture together ...
        try:
            return self.worker.capture(kind, size)
        finally:
            self.barrier()  # ... and leaves it together, failed or not

    def forget(self, kind: GraphSet, size: int) -> None:
        self.worker.forget(kind, size)

    def captured(self, kind: GraphSet) -> list[int]:
        return list(self.worker.captured(kind))

    # ---- run time ----------------------------------------------------------------------------
    def execute(self, cmd: ForwardCommand) -> ForwardResult:
        return self.worker.execute(cmd)

    def ping(self) -> int:
        return self.rank

    def freeze_heap(self) -> int:
        from service.heap import freeze_start_up_heap

        return freeze_start_up_heap(f"rank {self.rank}")

    def frozen_objects(self) -> int:
        """How many objects the garbage collector leaves alone (service.heap)."""
        import gc

        return gc.get_freeze_count()

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
