"""Whether a compiler the kernels need at run time answers (FlashInfer's nvcc, Triton's C
compiler): run with ``--version``, not only looked at, since a wrapper script whose toolkit is
gone is no compiler. Used once per rank at start-up (service.ranks.flashinfer_toolchain,
service.ranks.triton_toolchain)."""

from __future__ import annotations

import subprocess

COMPILER_TIMEOUT_S = 30.0  # a compiler's `--version` answers in well under a second


def check_compiler(path: str) -> str | None:
    """None when ``path --version`` runs and exits 0; otherwise why not, in a few words."""
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=COMPILER_TIMEOUT_S
        )
    except FileNotFoundError:
        return "not found"
    except PermissionError:
        return "not executable"
    except subprocess.TimeoutExpired:
        return f"`--version` did not answer within {COMPILER_TIMEOUT_S:g} s"
    except OSError as exc:
        return f"cannot run: {exc}"
    if out.returncode != 0:
        said = (out.stderr or out.stdout).strip().splitlines()
        return f"`--version` exited {out.returncode}" + (f" ({said[-1]})" if said else "")
    return None
