"""capture-service: a multi-rank prefill CUDA-graph capture service.

Importing the package is cheap: torch, ray and fastapi load only where they are used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from service.engine import Engine

__all__ = ["Engine", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from service.engine import Engine

        return Engine
    raise AttributeError(f"module 'service' has no attribute {name!r}")
