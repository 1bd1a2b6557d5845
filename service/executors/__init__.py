"""Executors: how the coordinator reaches its ranks (in this process, or a Ray actor per rank)."""

from __future__ import annotations

from service.config import EngineConfig
from service.executors.base import Executor


def make_executor(cfg: EngineConfig) -> Executor:
    """In-process for one local rank; Ray for several ranks or a cluster (or when asked)."""
    if cfg.executor == "local" or (
        cfg.executor == "auto" and cfg.tp == 1 and cfg.ray_address is None
    ):
        from service.executors.local import LocalExecutor

        return LocalExecutor(cfg)
    from service.executors.ray import RayExecutor

    return RayExecutor(cfg)
