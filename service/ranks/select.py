"""Which kernels a rank runs, for attention and for the model's fused elementwise chains: a pure
decision from the device, dtype and head dim.

``auto`` takes FlashInfer where it can run (a CUDA device, FlashInfer importable, a head dim its
kernels are built for, fp16/bf16) and plain torch otherwise, and says why, so that an operator
reading the log or ``/server_info`` knows which kernels serve and what would change it. An
explicit ``flashinfer`` that cannot run is an error that names the missing piece and the flag.
"""

from __future__ import annotations

from collections.abc import Callable

from service.errors import ConfigError
from service.rank_info import BackendChoice

# FlashInfer's prefill/decode templates are instantiated for these head dims (FA2 and FA3)
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = ("float16", "bfloat16")


# FlashInfer's MLA kernels are instantiated for these (kv_lora_rank, qk_rope_head_dim)
FLASHINFER_MLA_DIMS = (512, 64)


def flashinfer_blocker(
    device_type: str,
    dtype: str,
    head_dim: int,
    import_error: str | None,
    mla: tuple[int, int] | None = None,
) -> str | None:
    """Why FlashInfer cannot serve this rank, or None when it can. ``mla``: the model's
    (kv_lora_rank, qk_rope_head_dim) when its attention is MLA (then FlashInfer serves its
    decode graphs only; prefill stays on torch)."""
    if mla is not None and device_type == "cuda" and mla != FLASHINFER_MLA_DIMS:
        return (
            f"MLA widths {mla} (kv_lora_rank, qk_rope_head_dim) are not FlashInfer's "
            f"{FLASHINFER_MLA_DIMS}"
        )
    if mla is not None:
        head_dim = 64  # the checks below do not apply to MLA's head dims
    if device_type != "cuda":
        return f"FlashInfer needs a CUDA device (this rank runs on {device_type})"
    if import_error is not None:
        return f"FlashInfer is not importable ({import_error}); install the `gpu` extra"
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return f"head dim {head_dim} is not one of FlashInfer's {list(FLASHINFER_HEAD_DIMS)}"
    if dtype not in FLASHINFER_DTYPES:
        return f"dtype {dtype} is not one of FlashInfer's {list(FLASHINFER_DTYPES)}"
    return None


def choose(
    requested: str,
    flag: str,
    blocker: str | None,
    fast: str = "flashinfer",
    fast_reason: str = "auto: CUDA, FlashInfer installed, shapes supported",
    auto_blocker: str | None = None,
) -> BackendChoice:
    """``fast`` or torch for one ``flag``, given why ``fast`` cannot run (None: it can).
    ``auto_blocker``: why ``auto`` should not take it although it can run (asking for it by name
    still does)."""
    if requested == "torch":
        return BackendChoice("torch", f"asked for ({flag} torch)")
    if requested == fast:
        if blocker is not None:
            raise ConfigError(f"{flag} {fast} cannot run here: {blocker}; use {flag} auto or torch")
        return BackendChoice(fast, f"asked for ({flag} {fast})")
    if requested != "auto":
        raise ConfigError(f"unsupported {flag} {requested!r}; supported: auto, {fast}, torch")
    if blocker is None and auto_blocker is None:
        return BackendChoice(fast, fast_reason)
    return BackendChoice("torch", f"auto: {blocker or auto_blocker}")


def choose_attention(
    requested: str,
    device_type: str,
    dtype: str,
    head_dim: int,
    import_error: str | None,
    mla: tuple[int, int] | None = None,
) -> BackendChoice:
    blocker = flashinfer_blocker(device_type, dtype, head_dim, import_error, mla)
    choice = choose(requested, "--attention-backend", blocker)
    if mla is not None and choice.name == "flashinfer":
        return BackendChoice(
            "flashinfer",
            f"{choice.reason}; MLA: decode graphs on FlashInfer's MLA paged wrapper, prefill "
            "and eager decode on torch",
        )
    return choice


def choose_kernels(
    requested: str, device_type: str, dtype: str, head_dim: int, import_error: str | None
) -> BackendChoice:
    """The fused RMSNorm / rotary / SiLU-and-mul kernels (service.model.kernels)."""
    blocker = flashinfer_blocker(device_type, dtype, head_dim, import_error)
    return choose(requested, "--fused-kernels", blocker)


# the fused gate_up kernel's tiles were measured on Hopper (H200); elsewhere ask for it by name
GATE_UP_AUTO_ARCH = 9


def gate_up_blocker(
    device_type: str,
    dtype: str,
    capability: tuple[int, int] | None,
    import_error: str | None,
    shape_error: str | None = None,
) -> str | None:
    """Why the fused gate_up + SiLU-and-mul Triton kernel cannot run here, or None.
    ``shape_error``: why the model's gate_up shape does not fit it
    (service.model.gate_up_tiles.shape_blocker), or None."""
    if device_type != "cuda":
        return f"the fused kernel needs a CUDA device (this rank runs on {device_type})"
    if capability is None or capability[0] < 9:
        return (
            f"the fused kernel's TMA loads need sm90 or newer (this device is sm{_sm(capability)})"
        )
    if import_error is not None:
        return f"triton is not importable ({import_error})"
    if dtype not in FLASHINFER_DTYPES:
        return f"dtype {dtype} is not one of the fused kernel's {list(FLASHINFER_DTYPES)}"
    if shape_error is not None:
        return f"the model's gate_up does not fit the fused kernel: {shape_error}"
    return None


def _sm(capability: tuple[int, int] | None) -> str:
    return "?" if capability is None else f"{capability[0]}{capability[1]}"


def choose_gate_up(
    requested: str,
    device_type: str,
    dtype: str,
    capability: tuple[int, int] | None,
    import_error: str | None,
    shape_error: str | None = None,
) -> BackendChoice:
    """The MLP's gate_up GEMM + SiLU-and-mul: one Triton kernel ("triton", at the token counts
    service.model.gate_up_tiles picks) or the projection then the activation kernel ("torch")."""
    flag = "--gate-up-kernel"
    blocker = gate_up_blocker(device_type, dtype, capability, import_error, shape_error)
    untuned = None
    if capability is not None and capability[0] != GATE_UP_AUTO_ARCH:
        untuned = (
            f"the fused kernel's tiles are measured on sm90 only (this device is "
            f"sm{_sm(capability)}); pass {flag} triton to try it"
        )
    return choose(requested, flag, blocker, "triton", "auto: CUDA sm90, triton installed", untuned)


def triton_kernel_blocker(device_type: str, dtype: str, import_error: str | None) -> str | None:
    """Why one of the project's Triton kernels cannot run here, in the order an operator fixes
    it (device, then triton, then dtype), or None."""
    if device_type != "cuda":
        return f"the kernel needs a CUDA device (this rank runs on {device_type})"
    if import_error is not None:
        return f"triton is not importable ({import_error})"
    if dtype not in FLASHINFER_DTYPES:
        return f"dtype {dtype} is not one of the kernel's {list(FLASHINFER_DTYPES)}"
    return None


def choose_rope_store(
    requested: str,
    device_type: str,
    dtype: str,
    head_dim: int,
    fused_kernels: str,
    import_error: str | None,
    mla: bool = False,
) -> BackendChoice:
    """Rotary on q and k and the K/V store: one Triton kernel ("triton",
    service.model.rope_store_triton) or the rotary kernel, then the indexed store ("torch").
    The kernel reads the positions and the cos/sin table as FlashInfer's rotary does, so it runs
    with FlashInfer's fused kernels."""
    flag = "--rope-store-kernel"
    blocker = triton_kernel_blocker(device_type, dtype, import_error)
    if device_type == "cuda" and mla:
        blocker = "MLA's rotary is its own (interleaved pairs on the shared key)"
    elif blocker is None and (head_dim < 2 or head_dim & (head_dim - 1)):
        blocker = f"head dim {head_dim} is not a power of two"
    elif blocker is None and fused_kernels != "flashinfer":
        blocker = "it runs with FlashInfer's fused kernels (--fused-kernels flashinfer)"
    return choose(requested, flag, blocker, "triton", "auto: CUDA, triton installed, FlashInfer's "
                  "fused kernels")  # fmt: skip


# the split-K slices were measured on Hopper (the probe on an H200, the graphs' A/B on an H100,
# docs/benchmarks.md sessions 36-37); elsewhere ask for it by name
SPLITK_AUTO_ARCH = 9


def choose_splitk_norm(
    requested: str,
    device_type: str,
    dtype: str,
    capability: tuple[int, int] | None,
    tp_size: int,
    import_error: str | None,
) -> BackendChoice:
    """o_proj and down: a batched GEMM over K-slices whose float32 partials the following
    add-RMSNorm sums in one Triton kernel ("triton", service.model.splitk_triton, at the token
    counts service.model.splitk_policy picks), or cuBLAS's projection, then the norm ("torch")."""
    flag = "--splitk-norm-kernel"
    if device_type == "cuda" and tp_size != 1:
        blocker: str | None = (
            f"with --tp {tp_size} each projection's output is all-reduced before the norm, so "
            "the norm cannot sum its K-slices"
        )
    else:
        blocker = triton_kernel_blocker(device_type, dtype, import_error)
    untuned = None
    if capability is not None and capability[0] != SPLITK_AUTO_ARCH:
        untuned = (
            f"the split-K slices are measured on sm90 only (this device is sm{_sm(capability)}); "
            f"pass {flag} triton to try it"
        )
    return choose(requested, flag, blocker, "triton", "auto: CUDA sm90, tp 1, triton installed",
                  untuned)  # fmt: skip


def choose_prefill_schedule(
    requested: str,
    attention: str,
    flashinfer_kernel: str,
    capability: tuple[int, int] | None,
    mla: bool,
    prefill_backend: str,
    device_rewrite_error: Callable[[], str | None] = lambda: None,
) -> BackendChoice:
    """Which SM runs which work item of the prefill attention kernel: "balanced" (FlashInfer's
    FA3 items dealt again longest first across heads, service.ranks.attention.sm90_balance) or
    "own" (the kernel's own schedule). Only FA3 takes a schedule from the host.

    ``auto`` takes the balanced schedule for ``full``, whose graph deals each plan with a
    captured kernel: on the H200 (docs/benchmarks.md, session 45) that made ``full`` 3-5%
    faster at 2,048 tokens and up to 2% from 4,096, and at most 1.6% slower below (256 tokens).
    The segment backends and eager queue the kernel after each plan; measured so, they were
    1-3% faster at 2,048 tokens but 1-17% slower at 16-1,024, where the launch was pure cost.
    The launch is now skipped where the plan has at most one item per CTA: in session 46 the
    same kernels and device time as the own schedule there, but `breakable` still 1-4% slower
    at 16-1,024 tokens in both of two alternating rounds (2-3% faster at 2,048). (Session 47:
    where the balanced schedule runs, plans with more items than CTAs are written by the device
    planner instead, FlashInfer's host plan skipped; session 48: the segment backends replay the
    indptr copy and the planner as one small graph.) Session 48's A/B on an H100, three calls,
    either arm first: balanced 1.6-4.1% faster at 2,048 tokens in 6 of 6 pairs, but 2-14%
    slower at 16-256 in 15 of 16, with the same kernels and device busy time there. Session 49
    measured the processes' hosts beside each timing: the slow arm's whole host was slow (a
    pure-Python loop 60-84 us against 40-47, eager prefill 16-25 ms against 11-13), which the
    schedule's few checks per plan cannot cost; own-schedule processes were sometimes as slow
    (one with 5 more bytes of environment: eager 28 ms), balanced ones sometimes as fast, but
    the balanced ones were slow more often (9 of 13 against 4 of 13, Fisher's p = 0.12; a loop
    pinned to one vCPU flips between two speeds within a process on these VMs), and at 16 tokens
    balanced was slower in 12 of 13 pairs (-4.8 to +9.8%), 1.9-7.0% faster at 2,048 in 9 of 9.
    A segment bucket whose plans can never have more items than CTAs is now planned as
    FlashInfer plans it (no schedule work at all), not yet measured on a GPU. Until one process
    holding both schedules (benchmarks/schedule_ab.py) shows the small buckets even on a GPU,
    the segment backends keep the kernel's own schedule (``--prefill-schedule balanced`` asks
    for it where 2,048 tokens and up matter).

    ``device_rewrite_error``: the start-up probe of the device rewrite (service.ranks.attention.
    sm90_schedule.device_rewrite_error), run only where ``auto`` would deal again: where it
    fails, the rewrite would run on the host, which made ``full`` no faster (session 44), so
    ``auto`` keeps FlashInfer's schedule and says why."""
    flag = "--prefill-schedule"
    blocker = None
    if attention != "flashinfer":
        blocker = f"prefill attention is {attention}'s, not FlashInfer's FA3"
    elif mla:
        blocker = "MLA's prefill attention runs on torch"
    elif flashinfer_kernel == "fa2":
        blocker = "FlashInfer's FA2 kernel schedules itself (--flashinfer-kernel fa2)"
    elif capability is None or capability[0] != 9:
        where = "a CPU" if capability is None else f"sm{_sm(capability)}"
        blocker = f"FlashInfer runs FA3 on sm90 only (this rank runs on {where})"
    if requested == "own":
        return BackendChoice("own", f"asked for ({flag} own)")
    if requested == "balanced":
        if blocker is not None:
            raise ConfigError(f"{flag} balanced cannot run here: {blocker}; use {flag} auto or own")
        return BackendChoice("balanced", f"asked for ({flag} balanced)")
    if requested != "auto":
        raise ConfigError(f"unsupported {flag} {requested!r}; supported: auto, balanced, own")
    if blocker is None and prefill_backend == "full":  # docs/benchmarks.md, session 45
        failed = device_rewrite_error()
        if failed is not None:
            return BackendChoice("own", f"auto: the device rewrite failed its check ({failed})")
        return BackendChoice(
            "balanced",
            "auto: sm90, FA3, prefill backend full (its graphs deal each plan on the device; "
            "3-5% faster at 2,048 tokens on the H200)",
        )
    if blocker is None:
        return BackendChoice(
            "own",
            f"auto: FlashInfer's schedule for prefill backend {prefill_backend}: the balanced "
            "one was 2-7% faster at 2,048 tokens but up to 10% slower at 16 on an H100 "
            f"(ask for it with {flag} balanced)",
        )
    return BackendChoice("own", f"auto: {blocker}")


def triton_import_error() -> str | None:
    """None when ``import triton`` works, else the error's one-line text."""
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def flashinfer_import_error() -> str | None:
    """None when ``import flashinfer`` works, else the error's one-line text."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA/JIT set-up error raised at import
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None
