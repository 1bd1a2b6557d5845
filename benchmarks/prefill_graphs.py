"""Prefill latency per bucket: eager vs graph replay for each backend, side by side, one run.

Model: Qwen2.5-1.5B shapes with random bf16 weights (``--load-format random`` from a config.json
alone, through the same loader as real checkpoints). For every bucket the same real batch
(``ceil(bucket / context_length)`` requests filling the bucket) runs eagerly and through each
backend's captured graphs; the table shows medians of CUDA-event timings, the speedup, the
physical floor (max of weight bytes over the measured copy bandwidth and FLOPs over the
measured bf16 matmul rate), and capture seconds and memory per bucket.

    python benchmarks/prefill_graphs.py --out results.json [--backends full,breakable]

Absolute times only mean something on a GPU; on CPU the script runs (for a smoke test) but its
numbers are not reported anywhere.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.buckets import decide_replay, partition_bucket
from service.config import EngineConfig, GraphConfig
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.ranks.worker import RankWorker

QWEN25_15B = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def timed(fn, device: torch.device, iters: int) -> float:
    """Median milliseconds of ``fn`` (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def profile(title: str, fn) -> None:
    """Top CUDA kernels of three calls (where the time goes)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    print(f"--- profile: {title} (3 calls)")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)
    )


def device_rates(device: torch.device) -> tuple[float, float]:
    """(bytes/s of a device-to-device copy, bf16 matmul FLOP/s), measured now."""
    if device.type != "cuda":
        return 0.0, 0.0
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy_ms = timed(lambda: b.copy_(a), device, 10)
    n = 8192
    x = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    y = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    mm_ms = timed(lambda: x @ y, device, 10)
    # a copy reads and writes every byte
    return 2 * (1 << 30) / (copy_ms / 1e3), 2 * n**3 / (mm_ms / 1e3)


def prefill_flops(cfg, seq_lens: list[int]) -> float:
    t = sum(seq_lens)
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    linear = 2 * t * layers * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i)
    attn = 2 * 2 * layers * cfg.q_size * sum(n * (n + 1) / 2 for n in seq_lens)
    head = 2 * len(seq_lens) * h * cfg.vocab_size
    return linear + attn + head


def real_batch(worker: RankWorker, lens: list[int]) -> ForwardBatch:
    """A batch of real requests in distinct rows, KV slots from 1 (slot 0 is padding)."""
    rows, locs, cursor = [], [], 1
    for row, n in enumerate(lens):
        slots = list(range(cursor, cursor + n))
        cursor += n
        worker.req_to_token.write(row, 0, slots)
        rows.append(row)
        locs += slots
    layout = BatchLayout(ForwardMode.EXTEND, tuple(rows), (0,) * len(lens), tuple(lens))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, worker.info.vocab_size, (sum(lens),), generator=g).tolist()
    return ForwardBatch.build(layout, ids, locs, worker.device)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="full,breakable,tc_piecewise")
    ap.add_argument("--context-length", type=int, default=2048)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--buckets", default=None, help="default: the built-in bucket list")
    ap.add_argument("--max-running-requests", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="the built-in model (CPU smoke test)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", type=int, default=None, help="print kernels of this bucket")
    ap.add_argument("--attention", choices=("auto", "flashinfer", "torch"), default="auto")
    ap.add_argument("--flashinfer-kernel", choices=("auto", "fa2", "fa3"), default="auto")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(QWEN25_15B))
    base = EngineConfig(
        model_path=None if args.tiny else str(tmp),
        load_format="auto" if args.tiny else "random",
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        kv_cache_memory_bytes=4 << 30 if torch.cuda.is_available() else 256 << 20,
        attention_backend=args.attention,
        flashinfer_kernel=args.flashinfer_kernel,
    )
    buckets = tuple(int(b) for b in args.buckets.split(",")) if args.buckets else None
    rows: dict[int, dict] = {}
    refs: dict[int, torch.Tensor] = {}  # eager logits per bucket, the reference of every backend
    captures: dict[str, dict] = {}
    rates = None
    worker = None
    with torch.inference_mode():
        for backend in args.backends.split(","):
            graph = GraphConfig(backend, buckets)
            if worker is None:  # one model for all backends: same weights, a runner each
                worker = RankWorker(base)
                rates = device_rates(worker.device)
            plan = worker.resolve_local_plan(graph)
            worker.build_runner(plan)
            gc.collect()  # the previous backend's graphs must be gone before measuring
            if worker.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            t0 = time.perf_counter()
            mem0 = torch.cuda.memory_reserved() if worker.device.type == "cuda" else 0
            free0 = torch.cuda.mem_get_info()[0] if worker.device.type == "cuda" else 0
            stats = [
                worker.capture_bucket(plan, b) for b in sorted(plan.bucket_sizes, reverse=True)
            ]
            total_s = time.perf_counter() - t0
            extra = (free0 - torch.cuda.mem_get_info()[0]) if worker.device.type == "cuda" else 0
            failed = [s for s in stats if isinstance(s, str)]
            captures[backend] = {
                "seconds": round(total_s, 2),
                "extra_device_bytes": extra,
                "reserved_growth_bytes": (torch.cuda.memory_reserved() - mem0) if mem0 else 0,
                "num_buckets": len(stats) - len(failed),
                "failed": failed,
            }
            for stat in stats:
                if isinstance(stat, str):
                    continue
                b = stat.num_tokens
                lens = list(partition_bucket(b, args.context_length))
                batch = real_batch(worker, lens)
                decision = decide_replay(plan, b, len(lens))
                last = batch.last_token_indices()

                def graph_step(batch=batch, decision=decision, last=last, worker=worker):
                    hidden = worker.runner.run(batch, decision)
                    return worker.model.logits(hidden.index_select(0, last))

                def eager_step(batch=batch, decision=decision, last=last, worker=worker):
                    hidden = worker.eager_runner.run(batch, decision)
                    return worker.model.logits(hidden.index_select(0, last))

                row = rows.setdefault(b, {"bucket": b, "requests": len(lens)})
                if "eager_ms" not in row:
                    row["eager_ms"] = timed(eager_step, worker.device, args.iters)
                    flops = prefill_flops(worker.model.cfg, lens)
                    weight_bytes = sum(
                        p.numel() * p.element_size() for p in worker.model.parameters()
                    )
                    copy_bw, mm_rate = rates
                    row["floor_ms"] = (
                        max(weight_bytes / copy_bw, flops / mm_rate) * 1e3 if copy_bw else None
                    )
                    refs[b] = eager_step()
                row[f"{backend}_ms"] = timed(graph_step, worker.device, args.iters)
                if b == args.profile:
                    profile(f"{backend} bucket {b}", graph_step)
                    if f"eager_profiled_{b}" not in row:
                        row[f"eager_profiled_{b}"] = True
                        profile(f"eager bucket {b}", eager_step)
                out = graph_step()
                row[f"{backend}_maxdiff"] = float((out - refs[b]).abs().max())
                row[f"{backend}_capture_s"] = round(stat.seconds, 3)
                row[f"{backend}_capture_mib"] = round(stat.memory_bytes / 2**20, 1)
            worker.runner = worker.eager_runner  # release this backend's graphs
            if worker.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()

    backends = args.backends.split(",")
    head = (
        f"{'bucket':>6} {'reqs':>4} {'eager':>8} "
        + " ".join(f"{b:>12} {'x':>5}" for b in backends)
        + f" {'floor':>7}"
    )
    print(head)
    for b in sorted(rows):
        r = rows[b]
        cells = [f"{r['bucket']:>6} {r['requests']:>4} {r['eager_ms']:>8.2f}"]
        for be in backends:
            ms = r.get(f"{be}_ms")
            cells.append(f"{ms:>12.2f} {r['eager_ms'] / ms:>5.2f}" if ms else f"{'-':>12} {'-':>5}")
        cells.append(f"{r['floor_ms']:>7.2f}" if r.get("floor_ms") else f"{'-':>7}")
        print(" ".join(cells))
    for be, c in captures.items():
        print(
            f"capture {be}: {c['num_buckets']} buckets in {c['seconds']} s, "
            f"{c['extra_device_bytes'] / 2**20:.0f} MiB extra device memory, failed {c['failed']}"
        )
    print(f"attention: {worker.attention.name} ({worker.attention.reason})")
    if rates and rates[0]:
        print(
            f"measured: copy {rates[0] / 1e12:.2f} TB/s, bf16 matmul {rates[1] / 1e12:.0f} TFLOP/s"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"rows": [rows[b] for b in sorted(rows)], "captures": captures,
                        "copy_bytes_per_s": rates[0], "matmul_flops": rates[1],
                        "device": torch.cuda.get_device_name() if worker.device.type == "cuda"
                        else "cpu",
                        "attention": worker.attention.to_json(),
                        "torch": torch.__version__, "args": vars(args)}, indent=2)
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
