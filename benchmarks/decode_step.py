"""Decode step time per batch size: eager vs decode graph replay, against the floor, one run.

Model: Qwen2.5-1.5B shapes (or ``--model deepseek-v2-lite``) with random bf16 weights
(benchmarks/prefill_graphs.py). For each
batch size B, B requests sit in the KV cache with ``--context`` tokens each; one decode step is
the rank's whole ``execute`` of a decode command as the engine sends it (request-row writes, the
batch's device tensors, the forward, logits, batched sampling and the one copy of the sampled ids
to the host), timed on the host over ``--iters`` steps. The floor is the bytes one step must read
(all weights, and each request's K/V) over the measured copy bandwidth.

    python benchmarks/decode_step.py --out decode.json [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_clocks import ClockSampler
from benchmarks.prefill_graphs import MODELS, device_rates
from service.buckets import MISS_DISABLED
from service.capture_result import CaptureStat
from service.commands import ForwardCommand, RowWrite
from service.config import DecodeGraphConfig, EngineConfig, GraphConfig
from service.decode_sizes import DecodeDecision, decide_decode
from service.padding import PADDING_POSITION, PADDING_SLOT, PADDING_TOKEN_ID, SENTINEL_ROW
from service.ranks.runners.decode import DecodeStaticBuffers
from service.ranks.startup import set_up_rank
from service.ranks.worker import RankWorker
from service.sampling import SamplingParams


def step_ms(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()  # ends with the sampled ids on the host: the step is complete
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def per_field_copy(bufs: Any, batch: Any, size: int) -> Any:
    """The decode copy before 2e28c6f, for ``--copy-ab``: each of the four fields copied on its
    own and its slots past the batch filled with the pad, eight device ops a step."""
    b = batch.layout.num_requests
    for dst, src, pad in (
        (bufs.input_ids, batch.input_ids, PADDING_TOKEN_ID),
        (bufs.positions, batch.positions, PADDING_POSITION),
        (bufs.out_cache_loc, batch.out_cache_loc, PADDING_SLOT),
        (bufs.req_pool_indices, batch.req_pool_indices, SENTINEL_ROW),
    ):
        dst[:b].copy_(src)
        dst[b:size].fill_(pad)
    bufs.padding.dirtied(size)  # the slots it wrote, for the next copy
    return bufs.view(batch.layout, size)


def decode_command(
    batch: int, context: int, decision: DecodeDecision, vocab: int, pool_offset: int = 1
) -> ForwardCommand:
    """B requests in rows 0..B-1, each with ``context`` cached tokens; their new tokens take the
    next slot of their own range."""
    slots = [pool_offset + r * (context + 1) + context for r in range(batch)]
    return ForwardCommand(
        is_prefill=False,
        req_pool_indices=tuple(range(batch)),
        prefix_lens=(context,) * batch,
        extend_lens=(1,) * batch,
        input_ids=tuple((7 * r) % vocab for r in range(batch)),
        out_cache_loc=tuple(slots),
        row_writes=tuple(RowWrite(r, context, (s,)) for r, s in enumerate(slots)),
        sampling=(SamplingParams(max_new_tokens=1 << 20),) * batch,
        steps=(0,) * batch,
        decision=None,
        decode=decision,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=512, help="cached tokens per request")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="the built-in model (CPU smoke test)")
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b")
    ap.add_argument("--attention", choices=("auto", "flashinfer", "torch"), default="auto")
    ap.add_argument("--fused-kernels", choices=("auto", "flashinfer", "torch"), default="auto")
    ap.add_argument("--gate-up-kernel", choices=("auto", "triton", "torch"), default="auto")
    ap.add_argument("--rope-store-kernel", choices=("auto", "triton", "torch"), default="auto")
    ap.add_argument("--splitk-norm-kernel", choices=("auto", "triton", "torch"), default="auto")
    ap.add_argument("--profile", type=int, default=None, help="print kernels of this batch size")
    ap.add_argument("--copy-ab", action="store_true",
                    help="time graph steps with the per-field copy too, alternating")  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(MODELS[args.model]))
    ctx = 4096
    cfg = EngineConfig(
        model_path=None if args.tiny else str(tmp),
        load_format="auto" if args.tiny else "random",
        context_length=ctx,
        max_running_requests=max(batches),
        chunked_prefill_size=4096,
        kv_cache_memory_bytes=(8 << 30) if torch.cuda.is_available() else (256 << 20),
        graph=GraphConfig(backend="eager"),
        decode=DecodeGraphConfig(enabled=True, sizes=tuple(batches)),
        attention_backend=args.attention,
        fused_kernels=args.fused_kernels,
        gate_up_kernel=args.gate_up_kernel,
        rope_store_kernel=args.rope_store_kernel,
        splitk_norm_kernel=args.splitk_norm_kernel,
    )
    worker = RankWorker(set_up_rank(cfg))
    info = worker.info
    plans = worker.resolve_local_plans()
    worker.build_runners(plans.prefill, plans.decode)
    captures = {}
    for size in sorted(plans.decode.sizes, reverse=True):
        stat = worker.capture("decode", size)
        if not isinstance(stat, CaptureStat):
            raise SystemExit(f"capture of decode size {size} failed: {stat}")
        captures[size] = stat
    # the copy rate only (device_rates also times matmuls; its clock sampler is not needed here)
    copy_bw = device_rates(worker.device, ClockSampler())["copy"]
    weights = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    layout = worker.kv.layout
    packed_copy = DecodeStaticBuffers.copy_from
    rows = []
    for b in batches:
        if b * (args.context + 1) + 1 > info.num_kv_slots:
            print(f"batch {b}: the KV cache holds {info.num_kv_slots} tokens; skipped")
            continue
        graph_cmd = decode_command(b, args.context, decide_decode(plans.decode, b), info.vocab_size)
        eager_cmd = decode_command(
            b, args.context, DecodeDecision(False, None, 0, MISS_DISABLED), info.vocab_size
        )
        # the requests' cached tokens: each row holds its own slot range
        first = [1 + r * (args.context + 1) for r in range(b)]
        worker.req_to_token.write_many(
            [(r, 0, list(range(f, f + args.context))) for r, f in enumerate(first)]
        )
        kv_bytes = b * (args.context + 1) * layout.bytes_per_token
        row = {
            "batch": b,
            "eager_ms": step_ms(lambda c=eager_cmd: worker.execute(c), args.iters),
            "graph_ms": step_ms(lambda c=graph_cmd: worker.execute(c), args.iters),
            "floor_ms": (weights + kv_bytes) / copy_bw * 1e3 if copy_bw else None,
            "capture_s": round(captures[b].seconds, 3),
            "capture_mib": round(captures[b].memory_bytes / 2**20, 1),
        }
        if args.copy_ab:  # the batch's copy in one op against four copies and four fills
            new, old = [], []
            for _ in range(4):
                new.append(step_ms(lambda c=graph_cmd: worker.execute(c), args.iters))
                DecodeStaticBuffers.copy_from = per_field_copy
                try:
                    old.append(step_ms(lambda c=graph_cmd: worker.execute(c), args.iters))
                finally:
                    DecodeStaticBuffers.copy_from = packed_copy
            row["graph_ms_ab"] = statistics.median(new)
            row["graph_ms_per_field_copy"] = statistics.median(old)
        rows.append(row)
        if b == args.profile and worker.device.type == "cuda":
            from benchmarks.prefill_graphs import profile

            profile(f"decode graph step, batch {b}", lambda c=graph_cmd: worker.execute(c))
    print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'x':>5} {'floor ms':>9} {'/floor':>7}")
    for r in rows:
        fl = r["floor_ms"]
        print(
            f"{r['batch']:>5} {r['eager_ms']:>9.2f} {r['graph_ms']:>9.2f} "
            f"{r['eager_ms'] / r['graph_ms']:>5.2f} "
            + (f"{fl:>9.3f} {r['graph_ms'] / fl:>7.2f}" if fl else f"{'-':>9} {'-':>7}")
        )
    if args.copy_ab:
        print("decode copy A/B, graph ms (median of 4 alternating rounds): one copy / per field")
        for r in rows:
            print(f"{r['batch']:>5} {r['graph_ms_ab']:>9.3f} {r['graph_ms_per_field_copy']:>9.3f}")
    print(f"attention: {info.attention.name} ({info.attention.reason})")
    print(f"fused kernels: {info.kernels.name} ({info.kernels.reason})")
    print(f"gate_up kernel: {info.gate_up.name} ({info.gate_up.reason})")
    print(f"rope_store kernel: {info.rope_store.name} ({info.rope_store.reason})")
    print(f"splitk_norm kernel: {info.splitk_norm.name} ({info.splitk_norm.reason})")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "rows": rows,
                    "context": args.context,
                    "copy_bytes_per_s": copy_bw,
                    "device": torch.cuda.get_device_name()
                    if worker.device.type == "cuda"
                    else "cpu",
                    "attention": info.attention.to_json(),
                    "fused_kernels": info.kernels.to_json(),
                    "gate_up_kernel": info.gate_up.to_json(),
                    "rope_store_kernel": info.rope_store.to_json(),
                    "splitk_norm_kernel": info.splitk_norm.to_json(),
                    "torch": torch.__version__,
                    "args": vars(args),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
