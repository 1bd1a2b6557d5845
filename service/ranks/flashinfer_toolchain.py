"""Where FlashInfer's kernels come from on this machine: prebuilt, or built by nvcc on first use.

Why it matters: ``flashinfer-python`` ships kernel sources, not kernels. Each kernel family is
compiled by nvcc the first time it runs (30-90 s each on the H200's host; docs/benchmarks.md),
unless the ``flashinfer-jit-cache`` package holds it prebuilt. A machine with neither, such as a
container built on a CUDA *runtime* image (no compiler), imports FlashInfer fine and then fails
at the first kernel, in the middle of start-up. So ``auto`` takes FlashInfer only where its
kernels can be had (service.ranks.select), says which way, and otherwise serves on the torch
kernels with the reason; asking for FlashInfer by name still takes it (a JIT cache warmed
beforehand needs no compiler), with the reason logged as a warning.

The compiler is found as FlashInfer 0.7 finds it (flashinfer.jit.cpp_ext): ``FLASHINFER_NVCC``
if set, else ``bin/nvcc`` under ``CUDA_HOME`` (or ``CUDA_PATH``), else under the folder two up
from the ``nvcc`` on ``PATH``, else under ``/usr/local/cuda``; then it is run with ``--version``
(service.ranks.compilers). Nothing here imports FlashInfer (tests/test_flashinfer.py checks on
a GPU machine that FlashInfer would run the same compiler).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from service.ranks.compilers import check_compiler

JIT_CACHE_MODULE = "flashinfer_jit_cache"  # the package of prebuilt kernels (flashinfer-jit-cache)
DEFAULT_CUDA_HOME = "/usr/local/cuda"


@dataclass(frozen=True)
class KernelSource:
    """What FlashInfer can use on this machine to get its kernels."""

    prebuilt: bool  # flashinfer-jit-cache is installed
    nvcc: str | None  # the compiler FlashInfer would run, where it answers `--version`
    looked_for: str  # the compiler FlashInfer would run
    problem: str | None = None  # why that compiler cannot serve (None: it can)


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def find(
    env: Mapping[str, str] | None = None,
    which: Callable[[str], str | None] = shutil.which,
    check: Callable[[str], str | None] = check_compiler,
    has_module: Callable[[str], bool] = installed,
) -> KernelSource:
    """This machine's :class:`KernelSource` (the arguments are for tests)."""
    env = os.environ if env is None else env
    override = env.get("FLASHINFER_NVCC")
    if override:
        # FlashInfer writes it into its build file as the compiler command: a path or a name
        path = override if os.sep in override else (which(override) or override)
    else:
        cuda_home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
        if not cuda_home:
            on_path = which("nvcc")
            cuda_home = str(Path(on_path).parent.parent) if on_path else DEFAULT_CUDA_HOME
        path = str(Path(cuda_home) / "bin" / "nvcc")
    problem = check(path)
    return KernelSource(
        prebuilt=has_module(JIT_CACHE_MODULE),
        nvcc=None if problem else path,
        looked_for=path,
        problem=problem,
    )


def blocker(source: KernelSource) -> str | None:
    """Why FlashInfer could not get its kernels here, with what to change; None when it can."""
    if source.prebuilt or source.nvcc is not None:
        return None
    return (
        f"FlashInfer has no prebuilt kernels (flashinfer-jit-cache is not installed) and no "
        f"compiler to build them ({source.looked_for}: {source.problem}); install the CUDA toolkit "
        f"(a CUDA -devel image) or set CUDA_HOME or FLASHINFER_NVCC to it, or install "
        f"flashinfer-jit-cache"
    )


def describe(source: KernelSource) -> str:
    """One line for the log and /server_info: where the kernels come from."""
    if source.prebuilt:
        return "kernels prebuilt (flashinfer-jit-cache)"
    if source.nvcc is not None:
        return (
            f"kernels built by {source.nvcc} on first use (30-90 s a family on a fresh machine, "
            f"then loaded from FlashInfer's cache)"
        )
    return "kernels only from FlashInfer's cache (no compiler, no flashinfer-jit-cache)"
