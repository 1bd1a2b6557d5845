"""One error hierarchy: every error the service raises on purpose says what to change.

No torch import (the planner and the CLI use it). Each class names the kind of thing that is
wrong, so callers catch what they can handle and an operator reads where to look:

- :class:`ConfigError`: a start-up setting cannot work (a flag, a device, a backend choice);
- :class:`PlanError`: a bucket planner input is invalid (a kind of configuration error);
- :class:`CheckpointError`: a model folder cannot be loaded;
- :class:`CapacityError`: memory cannot hold what was asked (KV cache, request slots);
- :class:`RequestError`: one request can never run (the API answers 400 with the message);
- :class:`RankFailure`: a rank died, hung or poisoned its device; the engine is unhealthy;
- :class:`CaptureFailed`: one bucket could not be captured on one rank (the bucket is dropped).
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base of every deliberate error of the service."""


class ConfigError(ServiceError, ValueError):
    """A configuration value cannot work; the message names the flag to change."""


class PlanError(ConfigError):
    """A planner input is invalid; the message says which value to change."""


class CheckpointError(ServiceError, ValueError):
    """A checkpoint cannot be loaded; the message names the file or tensor and what to change."""


class CapacityError(ServiceError, RuntimeError):
    """Memory cannot hold what was asked; the message says which value to change."""


class RequestError(ServiceError, ValueError):
    """A request that can never run; the message says what to change."""


class RankFailure(ServiceError, RuntimeError):
    """A rank died, timed out or lost its device; the engine is unhealthy until rebuilt."""


class CaptureFailed(ServiceError, RuntimeError):
    """A bucket could not be captured on this rank (out of memory, a kernel error)."""
