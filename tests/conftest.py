"""Shared test set-up: the `gpu` marker skips without CUDA, with the reason shown."""

from __future__ import annotations

import importlib.util

import pytest


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="gpu: needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole test session, on loopback, shut down at the end."""
    import ray

    from service.executors.ray import ensure_ray

    ensure_ray(None)
    yield ray
    ray.shutdown()
