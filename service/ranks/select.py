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
from service.ranks import flashinfer_toolchain
from service.ranks.flashinfer_toolchain import KernelSource

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
    source: KernelSource | None = None,
) -> BackendChoice:
    """``source``: where FlashInfer's kernels would come from (service.ranks.
    flashinfer_toolchain.find; None where FlashInfer is not a candidate)."""
    blocker = flashinfer_blocker(device_type, dtype, head_dim, import_error, mla)
    choice = _choose_flashinfer(requested, "--attention-backend", blocker, source)
    if mla is not None and choice.name == "flashinfer":
        return BackendChoice(
            "flashinfer",
            f"{choice.reason}; MLA: decode graphs on FlashInfer's MLA paged wrapper, prefill "
            "and eager decode on torch",
        )
    return choice


def choose_kernels(
    requested: str,
    device_type: str,
    dtype: str,
    head_dim: int,
    import_error: str | None,
    source: KernelSource | None = None,
) -> BackendChoice:
    """The fused RMSNorm / rotary / SiLU-and-mul kernels (service.model.kernels)."""
    blocker = flashinfer_blocker(device_type, dtype, head_dim, import_error)
    return _choose_flashinfer(requested, "--fused-kernels", blocker, source)


def _choose_flashinfer(
    requested: str, flag: str, blocker: str | None, source: KernelSource | None
) -> BackendChoice:
    """:func:`choose` for a FlashInfer flag, given where its kernels would come from: ``auto``
    does not take FlashInfer where it could not get its kernels (no compiler, nothing
    prebuilt), though by name it is still taken (a warmed JIT cache needs neither); a FlashInfer
    choice's reason says where its kernels come from (logged, /server_info)."""
    if source is None:
        return choose(requested, flag, blocker)
    choice = choose(requested, flag, blocker, auto_blocker=flashinfer_toolchain.blocker(source))
    if choice.name != "flashinfer":
        return choice
    return BackendChoice(choice.name, f"{choice.reason}; {flashinfer_toolchain.describe(source)}")


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
    build_error: str | None = None,
) -> BackendChoice:
    """The MLP's gate_up GEMM + SiLU-and-mul: one Triton kernel ("triton", at the token counts
    service.model.gate_up_tiles picks) or the projection then the activation kernel ("torch").
    ``build_error``: why Triton could not build its launchers here (service.ranks.
    triton_toolchain.blocker), as for the other Triton kernels: ``auto`` then keeps torch."""
    flag = "--gate-up-kernel"
    blocker = gate_up_blocker(device_type, dtype, capability, import_error, shape_error)
    untuned = None
    if capability is not None and capability[0] != GATE_UP_AUTO_ARCH:
        untuned = (
            f"the fused kernel's tiles are measured on sm90 only (this device is "
            f"sm{_sm(capability)}); pass {flag} triton to try it"
        )
    return choose(requested, flag, blocker, "triton", "auto: CUDA sm90, triton installed",
                  build_error or untuned)  # fmt: skip


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
    build_error: str | None = None,
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
                  "fused kernels", build_error)  # fmt: skip


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
    build_error: str | None = None,
    float32_bmm: str | None = None,
) -> BackendChoice:
    """o_proj and down: a batched GEMM over K-slices whose float32 partials the following
    add-RMSNorm sums in one Triton kernel ("triton", service.model.splitk_triton, at the token
    counts service.model.splitk_policy picks), or cuBLAS's projection, then the norm ("torch").
    ``float32_bmm``: why this torch cannot write the partials in float32 from a bf16/fp16
    product (:func:`float32_bmm_error`), or None."""
    flag = "--splitk-norm-kernel"
    if device_type == "cuda" and tp_size != 1:
        blocker: str | None = (
            f"with --tp {tp_size} each projection's output is all-reduced before the norm, so "
            "the norm cannot sum its K-slices"
        )
    else:
        blocker = triton_kernel_blocker(device_type, dtype, import_error)
        if blocker is None and device_type == "cuda":
            blocker = float32_bmm
    untuned = None
    if capability is not None and capability[0] != SPLITK_AUTO_ARCH:
        untuned = (
            f"the split-K slices are measured on sm90 only (this device is sm{_sm(capability)}); "
            f"pass {flag} triton to try it"
        )
    return choose(requested, flag, blocker, "triton", "auto: CUDA sm90, tp 1, triton installed",
                  build_error or untuned)  # fmt: skip


# What the balanced schedule gained where ``auto`` takes it (docs/benchmarks.md, sessions 45, 50)
GRAPH_SCHEDULE_GAINS = {
    "full": "its graphs deal each plan on the device; 3-5% faster at 2,048 tokens on the H200",
    "breakable": "buckets that can exceed the CTAs dealt on the device, smaller ones planned as "
    "FlashInfer plans them; 4% faster at 2,048 tokens, even at 16-256 on an H100",
    "tc_piecewise": "buckets that can exceed the CTAs dealt on the device, smaller ones planned "
    "as FlashInfer plans them; 5% faster at 2,048 tokens, even at 16-256 on an H100",
}


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

    ``auto`` takes the balanced schedule for the graph backends. ``full``'s graph deals each
    plan with a captured kernel: on the H200 (docs/benchmarks.md, session 45) that made ``full``
    3-5% faster at 2,048 tokens and up to 2% from 4,096, and at most 1.6% slower below (256
    tokens). The segment backends plan each replay: where a bucket's plans can exceed the CTAs
    their graphs replay FlashInfer's indptr copy and the device planner as one small graph
    (sessions 47-48), and a bucket whose plans never can (up to 512 tokens for 12 heads over 8
    request slots on 132 SMs) is planned exactly as FlashInfer plans it, with no schedule work
    (session 49). Session 50 measured that in one process holding both schedules, their replays
    alternating (benchmarks/schedule_ab.py, an H100): 16 and 256 tokens even (-0.4 to +0.5%),
    2,048 tokens 4.2% (``breakable``) and 5.0% (``tc_piecewise``) faster, in 8 of 8 rounds,
    logits equal. (Sessions 46-49 had put the segment backends 2-14% slower at 16-256 tokens,
    measured across processes whose whole host ran at two speeds: docs/benchmarks.md, session
    49.) Eager queues the dealing kernel after each plan at every size and keeps FlashInfer's
    schedule.

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
    if blocker is None and prefill_backend in GRAPH_SCHEDULE_GAINS:  # docs/benchmarks.md
        failed = device_rewrite_error()
        if failed is not None:
            return BackendChoice("own", f"auto: the device rewrite failed its check ({failed})")
        return BackendChoice(
            "balanced",
            f"auto: sm90, FA3, prefill backend {prefill_backend} "
            f"({GRAPH_SCHEDULE_GAINS[prefill_backend]})",
        )
    if blocker is None:
        return BackendChoice(
            "own",
            f"auto: FlashInfer's schedule for prefill backend {prefill_backend}: it queues the "
            f"dealing kernel after every plan (ask for the balanced one with {flag} balanced)",
        )
    return BackendChoice("own", f"auto: {blocker}")


def float32_bmm_error(overloads: list[str], version: str) -> str | None:
    """Why the split-K partials cannot come from one cuBLAS call here (service.model.splitk:
    ``torch.bmm(..., out_dtype=torch.float32)``, the ``aten::bmm.dtype`` overload, missing from
    older torch), given ``torch.ops.aten.bmm.overloads()``; None when they can."""
    if "dtype" in overloads:
        return None
    return f"torch {version} has no float32-output bmm (aten::bmm.dtype); upgrade torch"


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
