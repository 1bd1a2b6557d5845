"""Which attention kernels a rank runs: a pure decision from the device, dtype and head dim.

``auto`` takes FlashInfer where it can run (a CUDA device, FlashInfer importable, a head dim its
kernels are built for, fp16/bf16) and the plain-torch pair otherwise, and says why, so that an
operator reading the log or ``/server_info`` knows which kernels serve and what would change it.
An explicit ``flashinfer`` that cannot run is an error that names the missing piece.
"""

from __future__ import annotations

from service.errors import ConfigError
from service.rank_info import AttentionChoice

# FlashInfer's prefill/decode templates are instantiated for these head dims (FA2 and FA3)
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = ("float16", "bfloat16")


def flashinfer_blocker(
    device_type: str, dtype: str, head_dim: int, import_error: str | None
) -> str | None:
    """Why FlashInfer cannot serve this rank, or None when it can."""
    if device_type != "cuda":
        return f"FlashInfer needs a CUDA device (this rank runs on {device_type})"
    if import_error is not None:
        return f"FlashInfer is not importable ({import_error}); install the `gpu` extra"
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return f"head dim {head_dim} is not one of FlashInfer's {list(FLASHINFER_HEAD_DIMS)}"
    if dtype not in FLASHINFER_DTYPES:
        return f"dtype {dtype} is not one of FlashInfer's {list(FLASHINFER_DTYPES)}"
    return None


def choose_attention(
    requested: str, device_type: str, dtype: str, head_dim: int, import_error: str | None
) -> AttentionChoice:
    if requested == "torch":
        return AttentionChoice("torch", "asked for (--attention-backend torch)")
    blocker = flashinfer_blocker(device_type, dtype, head_dim, import_error)
    if requested == "flashinfer":
        if blocker is not None:
            raise ConfigError(
                f"--attention-backend flashinfer cannot run here: {blocker}; "
                "use --attention-backend auto or torch"
            )
        return AttentionChoice("flashinfer", "asked for (--attention-backend flashinfer)")
    if requested != "auto":
        raise ConfigError(f"unsupported attention backend {requested!r}")
    if blocker is None:
        return AttentionChoice("flashinfer", "auto: CUDA, FlashInfer installed, shapes supported")
    return AttentionChoice("torch", f"auto: {blocker}")


def flashinfer_import_error() -> str | None:
    """None when ``import flashinfer`` works, else the error's one-line text."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA/JIT set-up error raised at import
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None
