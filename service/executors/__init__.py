"""Executors: how the coordinator reaches its ranks (in this process, or a Ray actor per rank)."""

from __future__ import annotations

from service.config import EngineConfig
from service.executors.base import Executor


def uses_ray(cfg: EngineConfig) -> bool:
    """Ray for several ranks or a cluster, or when asked; in-process for one local rank."""
    return cfg.executor == "ray" or (
        cfg.executor == "auto" and (cfg.tp > 1 or cfg.ray_address is not None)
    )


def make_executor(cfg: EngineConfig) -> Executor:
    if not uses_ray(cfg):
        from service.executors.local import LocalExecutor

        return LocalExecutor(cfg)
    from service.executors.ray import RayExecutor

    return RayExecutor(cfg)
