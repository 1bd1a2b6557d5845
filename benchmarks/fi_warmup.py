"""Build FlashInfer's JIT kernels in parallel before the measured work (one process per family).

FlashInfer compiles each kernel family on first use (30-90 s each, one after the other when a
program meets them in turn). This runs one small call per family, each in its own process, so
the families compile at the same time, into FlashInfer's on-disk cache, which every later
process on the machine reuses. Shapes: bf16, head dim 128 (the benchmark model and the GPU
tests' model share every template parameter but the head counts, which are run-time values).

    python benchmarks/fi_warmup.py
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

T, H, D = 64, 1536, 128


def norm() -> None:
    import flashinfer

    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    flashinfer.norm.rmsnorm(x, w, 1e-6)
    flashinfer.norm.fused_add_rmsnorm(x, x.clone(), w, 1e-6)


def rope() -> None:
    import flashinfer

    q = torch.randn(T, 12 * D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, 2 * D, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(4096, D, device="cuda", dtype=torch.float32)
    pos = torch.arange(T, device="cuda")
    flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, cache, is_neox=True)


def activation() -> None:
    import flashinfer

    flashinfer.activation.silu_and_mul(torch.randn(T, 2 * H, device="cuda", dtype=torch.bfloat16))


def engine(prefill_backend: str, decode: bool) -> None:
    """A tiny bf16 model of head dim 128 through the service itself: eager (ragged, paged and
    decode paths) and the graph attention of ``prefill_backend`` and of decode graphs."""
    import json
    import tempfile

    from service.config import DecodeGraphConfig, EngineConfig, GraphConfig
    from service.engine import Engine
    from service.sampling import SamplingParams
    from tests.fi_model import FI_CONFIG

    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(FI_CONFIG))
    e = Engine(
        EngineConfig(
            model_path=str(tmp), load_format="random", device="cuda", context_length=256,
            max_running_requests=4, chunked_prefill_size=128, kv_cache_memory_bytes=64 << 20,
            graph=GraphConfig(backend=prefill_backend, buckets=(64, 128)),
            decode=DecodeGraphConfig(enabled=decode, sizes=(1, 2)),
        )
    )  # fmt: skip
    # 200 tokens over a 128-token chunk: a ragged prefill, then a paged one on the prefix
    e.generate([[1] * 200, [2] * 3], SamplingParams(max_new_tokens=3, ignore_eos=True))


JOBS = {
    "norm": norm,
    "rope": rope,
    "activation": activation,
    "attention": lambda: engine("breakable", decode=True),
    "attention_graph": lambda: engine("full", decode=False),
}


def run(name: str) -> tuple[str, float, str]:
    t0 = time.perf_counter()
    try:
        JOBS[name]()
        return name, time.perf_counter() - t0, "ok"
    except Exception as exc:  # reported, not fatal: the measured run shows what fails
        return name, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}".splitlines()[0]


def main() -> int:
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(len(JOBS)) as pool:
        for name, seconds, status in pool.imap_unordered(run, list(JOBS)):
            print(f"flashinfer warm-up {name}: {seconds:.1f} s, {status}", flush=True)
    print(f"flashinfer warm-up done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
