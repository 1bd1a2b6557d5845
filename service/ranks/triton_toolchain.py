"""Whether Triton can build what its kernels need at run time here: a C compiler and Python's
headers.

Why it matters: Triton compiles a small C launcher for each kernel signature, and its CUDA
driver's helpers, with the machine's C compiler against ``Python.h``, the first time a kernel
runs (then loads them from its cache). A machine without them (a slim Python image with a pip
torch) imports triton fine and then fails at the first Triton kernel, during capture. So
``auto`` takes the project's Triton kernels (gate_up, rope_store, the split-K norm) only where
both are there, and otherwise the torch path with the reason; by name they are still taken (a
Triton cache warmed beforehand needs neither), with the reason logged as a warning.

The compiler is found as Triton 3.x finds it (triton.runtime.build): ``CC`` if set, else ``gcc``
on ``PATH``, else ``clang``; then run with ``--version`` (service.ranks.compilers). The headers
are looked for where Triton points the compiler: the ``include`` path of the default install
scheme (``posix_local`` read as ``posix_prefix``, as Triton does).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from service.ranks.compilers import check_compiler


@dataclass(frozen=True)
class LauncherBuild:
    """What Triton would build its launchers with, and why it could not (None: it can)."""

    cc: str | None  # the C compiler Triton would run
    python_h: str  # where Triton looks for Python's headers
    problem: str | None


def python_include() -> str:
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":  # Debian's; Triton reads its prefix scheme instead
        scheme = "posix_prefix"
    return sysconfig.get_paths(scheme=scheme)["include"]


def find(
    env: Mapping[str, str] | None = None,
    which: Callable[[str], str | None] = shutil.which,
    check: Callable[[str], str | None] = check_compiler,
    include: str | None = None,
) -> LauncherBuild:
    """This machine's :class:`LauncherBuild` (the arguments are for tests)."""
    env = os.environ if env is None else env
    python_h = str(Path(include or python_include()) / "Python.h")
    cc = env.get("CC") or which("gcc") or which("clang")
    if cc is None:
        problem: str | None = "no C compiler (CC is unset and neither gcc nor clang is on PATH)"
    elif (failed := check(cc)) is not None:
        problem = f"the C compiler {cc}: {failed}"
    elif not os.path.isfile(python_h):
        problem = f"no {python_h} (Python's development headers)"
    else:
        problem = None
    return LauncherBuild(cc=cc, python_h=python_h, problem=problem)


def blocker(build: LauncherBuild) -> str | None:
    """Why Triton could not build its kernels' launchers here, with what to change; None when
    it can."""
    if build.problem is None:
        return None
    return (
        f"Triton builds each kernel's launcher with a C compiler against Python's headers on "
        f"first use, and here there is {build.problem}; install gcc and Python's development "
        f"headers (build-essential, python3-dev) or set CC"
    )
