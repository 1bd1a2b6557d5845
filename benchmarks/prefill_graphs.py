"""Prefill latency per bucket: eager vs graph replay for each backend, side by side, one run.

Model: Qwen2.5-1.5B shapes (or, with ``--model deepseek-v2-lite``, DeepSeek-V2-Lite's: MLA and
64 routed experts) with random bf16 weights (``--load-format random`` from a config.json alone,
through the same loader as real checkpoints). For every bucket the same real batch
(``ceil(bucket / context_length)`` requests filling the bucket) runs eagerly and through each
backend's captured graphs; the table shows medians of CUDA-event timings, the speedup, the
physical floor (max of weight bytes over the measured copy bandwidth and FLOPs over the
measured bf16 matmul rate) and each time's ratio to it, the CUDA kernels one forward launches
(from the profiler), and capture seconds and memory per bucket. ``--hf-compiled`` adds Hugging
Face transformers' model of the same shapes under ``torch.compile`` plus one CUDA graph, measured
in the same run.

    python benchmarks/prefill_graphs.py --out results.json [--backends full,breakable]

Absolute times only mean something on a GPU; on CPU the script runs (for a smoke test) but its
numbers are not reported anywhere.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

# after PYTHONPATH, so that the ab arm's older service/ (gpu_run.sh) is the one imported
sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_clocks import ClockSampler
from benchmarks.host_speed import ThreadWatch, host_speed, python_loop_us, speed_line, summary
from benchmarks.host_steps import HEADER as STEPS_HEADER
from benchmarks.host_steps import checks_hooks, host_steps, line_costs, ops_row, replan_ops
from benchmarks.host_steps import row as steps_row
from benchmarks.targets import report, verdicts
from benchmarks.timeline import HEADER as TIMELINE_HEADER
from benchmarks.timeline import Timeline, host_ms, one_call_ms, timed, timeline
from benchmarks.timeline import row as timeline_row
from service.buckets import ReplayDecision, ResolvedRequestPool, decide_replay, partition_bucket
from service.capture_result import CaptureStat
from service.config import DecodeGraphConfig, EngineConfig, GraphConfig
from service.decode_sizes import DecodePlan
from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
from service.ranks.runners.base import PrefillRunner
from service.ranks.startup import set_up_rank
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


# DeepSeek-V2-Lite's config.json (deepseek-ai/DeepSeek-V2-Lite), the fields the model reads
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "tie_word_embeddings": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}
MODELS = {"qwen2.5-1.5b": QWEN25_15B, "deepseek-v2-lite": DEEPSEEK_V2_LITE}


def paired(
    fns: dict,
    device: torch.device,
    iters: int,
    clocks: ClockSampler,
    rounds: int = 4,
    host_loop: list[float] | None = None,
) -> dict:
    """{name: (median ms, mean SM MHz or None)} of each fn, timed in alternating rounds (the
    first fn's share of ``iters``, then the second's, ...), so that clocks or temperature
    drifting over the run fall on each alike: the fair "graph vs eager" comparison.
    ``host_loop``: filled with the host's pure-Python loop time (µs, host_speed) before each
    round, so that two processes' timings can be compared at the host speed they ran at."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    samples: dict = {name: [] for name in fns}
    windows: dict = {name: [] for name in fns}
    per_round = max(1, iters // rounds)
    for _ in range(rounds):
        if host_loop is not None:
            host_loop.append(python_loop_us())
        for name, fn in fns.items():
            t0 = time.perf_counter()
            samples[name] += [one_call_ms(fn, device) for _ in range(per_round)]
            windows[name].append((t0, time.perf_counter()))
    return {
        name: (statistics.median(samples[name]), clocks.mean_mhz(windows[name])) for name in fns
    }


def kernel_times(fn) -> dict[str, tuple[float, float]]:
    """{kernel name: (launches per call, device microseconds per call)} over three calls."""
    out: dict[str, list[float]] = {}
    for e in device_events(fn):
        got = out.setdefault(e.name, [0.0, 0.0])
        got[0] += 1 / 3
        got[1] += e.device_time / 3
    return {k: (v[0], v[1]) for k, v in out.items()}


def device_events(fn) -> list:
    """The profiler's device events (kernels, copies, memsets) of three calls of ``fn``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_diff(title: str, eager: dict, graph: dict, rows: int = 14) -> None:
    """Per kernel, eager against graph replay: where a graph's device time differs."""
    print(f"--- kernel diff: {title} (us per call; sorted by |graph - eager|)")
    print(f"{'n eager':>8} {'eager us':>10} {'n graph':>8} {'graph us':>10} {'diff':>9}  kernel")

    def gap(k: str) -> float:
        return -abs(graph.get(k, (0, 0.0))[1] - eager.get(k, (0, 0.0))[1])

    names = sorted(set(eager) | set(graph), key=gap)
    for k in names[:rows]:
        (ne, te), (ng, tg) = eager.get(k, (0, 0.0)), graph.get(k, (0, 0.0))
        print(f"{ne:>8.0f} {te:>10.1f} {ng:>8.0f} {tg:>10.1f} {tg - te:>+9.1f}  {k[:90]}")
    te, tg = sum(v[1] for v in eager.values()), sum(v[1] for v in graph.values())
    print(f"{'':>8} {te:>10.1f} {'':>8} {tg:>10.1f} {tg - te:>+9.1f}  (all)")


def device_profile(fn) -> tuple[float, float]:
    """(CUDA kernels one call of ``fn`` launches, graph replays included; milliseconds the
    device is busy per call: the sum of its kernels', copies' and memsets' durations), from the
    profiler over three calls. Busy time against the CUDA-event time says how much of a call the
    device spends waiting for the host."""
    device = device_events(fn)
    kernels = [e for e in device
               if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]  # fmt: skip
    busy_us = sum(e.device_time for e in device)
    return len(kernels) / 3, busy_us / 3 / 1e3


def hf_compiled_ms(config: dict, tokens: int, iters: int) -> float:
    """Hugging Face's model of ``config`` (random bf16 weights, sdpa), compiled and captured as
    one CUDA graph, logits of the last token only: the reference a user could build."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        config["architectures"][0].replace("ForCausalLM", "").lower(),
        **{k: v for k, v in config.items() if k != "architectures"},
    )
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(0, config["vocab_size"], (1, tokens), device="cuda")
    step = torch.compile(lambda x: model(x, logits_to_keep=1).logits)
    with torch.inference_mode():
        for _ in range(3):
            step(ids)
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(ids)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            step(ids)
        return timed(graph.replay, torch.device("cuda"), iters)


def profile(title: str, fn, rows: int = 12) -> None:
    """Top ``rows`` CUDA kernels of three calls (where the time goes)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    print(f"--- profile: {title} (3 calls)")
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))
    print(f"--- host side: {title} (3 calls, by self CPU time)")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))


def host_profile(title: str, fn, calls: int = 20) -> None:
    """Python functions by own host time over ``calls`` calls (cProfile): which host code stands
    between the device's kernels."""
    import cProfile
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    print(f"--- host functions: {title} ({calls} calls, by own time)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


BURSTS = 3  # idle-then-burst matmul samples of the floor's rate


def device_rates(device: torch.device, clocks: ClockSampler) -> dict:
    """Bytes/s of a device-to-device copy and bf16 matmul FLOP/s, measured now.

    The matmul rate twice: ``burst`` (the fastest of ``BURSTS`` x 10 products, each burst from
    an idle GPU, the way a short benchmark sees it; each burst's median in
    ``matmul_burst_medians``) and ``sustained`` (after a second of back-to-back products, at the
    clocks the board's power limit settles to, which is where a forward of thousands of tokens
    runs). ``floor_ms`` (the table's ratios) uses the sustained rate and ``floor_burst_ms`` the
    burst rate; which one a bucket is held to depends on the clock it ran at (the ``*_mhz``
    fields): a bucket that runs at full clocks, as the small ones do, is held to the burst
    floor."""
    if device.type != "cuda":
        return {"copy": 0.0, "matmul": 0.0}
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy_ms = timed(lambda: b.copy_(a), device, 10)
    n = 8192
    x = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    y = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    # The burst rate is the floor's divisor, so its noise is the ratios' noise: the median of one
    # burst of 10 products moved by 745-783 TFLOP/s between processes on one H100 (session 42),
    # 1.34-1.42x at 2,048 tokens for the same graph times. A floor is a best case, and a slow
    # sample only means the board was not at its best then: the fastest product of three bursts,
    # each from an idle second, is the rate (each burst's median is kept beside it).
    burst_runs: list[list[float]] = []
    burst_window = []
    for _ in range(BURSTS):
        torch.cuda.synchronize(device)
        time.sleep(1.0)  # idle: clocks back up
        t0 = time.perf_counter()
        for _ in range(3):
            x @ y
        burst_runs.append([one_call_ms(lambda: x @ y, device) for _ in range(10)])
        burst_window.append((t0, time.perf_counter()))
    burst_ms = min(min(run) for run in burst_runs)
    t_end = time.perf_counter() + 1.0
    while time.perf_counter() < t_end:
        for _ in range(50):
            x @ y
        torch.cuda.synchronize(device)
    sustained_ms = timed(lambda: x @ y, device, 20)
    # the timed products alone last tens of ms, shorter than the clock sampler's period: the
    # clock is read over the last half second of the load, which runs at the same settled clock
    sustained_window = [(t_end - 0.5, time.perf_counter())]
    flops = 2 * n**3
    return {
        "copy": 2 * (1 << 30) / (copy_ms / 1e3),  # a copy reads and writes every byte
        "matmul": flops / (sustained_ms / 1e3),
        "matmul_burst": flops / (burst_ms / 1e3),
        "matmul_burst_medians": [flops / (statistics.median(r) / 1e3) for r in burst_runs],
        "matmul_mhz": clocks.mean_mhz(sustained_window),
        "matmul_burst_mhz": clocks.mean_mhz(burst_window),
    }


def tape_steps(runner) -> str | None:
    """A segment runner's replay tape of its largest bucket: graphs, attention calls, copies."""
    buckets = runner.captured_buckets() if hasattr(runner, "captured_buckets") else ()
    if not buckets:
        return None
    tape = runner._captured[max(buckets)]
    tape = getattr(tape, "tape", tape)
    if not hasattr(tape, "num_copies"):
        return None
    return (f"{len(tape.graphs)} graphs, {tape.num_attention_calls} attention calls, "
            f"{tape.num_copies} copies")  # fmt: skip


def prefill_flops(cfg, seq_lens: list[int]) -> float:
    if cfg.mla is not None:  # MoE: each token multiplies by its active parameters only
        m, moe = cfg.mla, cfg.moe
        unused = cfg.vocab_size * cfg.hidden_size  # the embedding is a lookup
        if moe is not None:
            moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
            per_expert = 3 * cfg.hidden_size * moe.moe_intermediate_size
            unused += moe_layers * (moe.num_experts - moe.top_k) * per_expert
        active = cfg.num_parameters() - unused
        pairs = sum(n * (n + 1) / 2 for n in seq_lens)
        attn = (
            2
            * cfg.num_hidden_layers
            * cfg.num_attention_heads
            * (m.qk_head_dim + m.v_head_dim)
            * pairs
        )
        return 2 * sum(seq_lens) * active + attn
    t = sum(seq_lens)
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    linear = 2 * t * layers * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i)
    attn = 2 * 2 * layers * cfg.q_size * sum(n * (n + 1) / 2 for n in seq_lens)
    head = 2 * len(seq_lens) * h * cfg.vocab_size
    return linear + attn + head


def logits_step(
    worker: RankWorker, runner: PrefillRunner, batch: ForwardBatch, decision: ReplayDecision
) -> Callable[[], torch.Tensor]:
    """One timed call: ``batch``'s prefill through ``runner``, then the logits of each request's
    last token (as the service samples them)."""
    last = batch.last_token_indices()

    def step() -> torch.Tensor:
        return worker.model.logits(runner.run(batch, decision).index_select(0, last))

    return step


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
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", type=int, default=None, help="print kernels of this bucket")
    ap.add_argument("--profile-rows", type=int, default=12, help="kernels listed per profile")
    ap.add_argument(
        "--host-profile", type=int, default=None, help="print host functions of this bucket"
    )
    ap.add_argument(
        "--kernel-diff", type=int, default=None, help="per-kernel eager vs graph at this bucket"
    )
    ap.add_argument(
        "--timeline",
        default="",
        help="buckets whose calls are placed on the profiler's clock (host work before the "
        "first device op, graph launch, device idle)",
    )
    ap.add_argument(
        "--host-steps",
        default="",
        help="buckets whose segment-runner replays are timed step by step on the host "
        "(unprofiled: the token copy, first launch, plan, each launch)",
    )
    ap.add_argument("--attention", choices=("auto", "flashinfer", "torch"), default="auto")
    ap.add_argument("--flashinfer-kernel", choices=("auto", "fa2", "fa3"), default="auto")
    ap.add_argument("--fused-kernels", choices=("auto", "flashinfer", "torch"), default="auto")
    ap.add_argument("--gate-up-kernel", choices=("auto", "triton", "torch"), default="auto")
    ap.add_argument("--rope-store-kernel", choices=("auto", "triton", "torch"), default="auto")
    ap.add_argument("--splitk-norm-kernel", choices=("auto", "triton", "torch"), default="auto")
    ap.add_argument(
        "--prefill-schedule", choices=("auto", "balanced", "own"), default="auto",
        help="one for every backend of the run; auto: the service's choice for the first backend",
    )  # fmt: skip
    ap.add_argument("--hf-compiled", default="", help="token counts to measure HF compiled at")
    ap.add_argument(
        "--kernel-count-buckets",
        default="16,256,2048,8192",
        help="buckets whose kernels per forward are counted with the profiler ('' for none)",
    )
    ap.add_argument(
        "--stacks-every",
        type=float,
        default=0.0,
        help="while capturing, print every thread's Python stack to stderr every this many "
        "seconds (0: never): where a slow capture spends its time",
    )
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(MODELS[args.model]))
    base = EngineConfig(
        model_path=None if args.tiny else str(tmp),
        load_format="auto" if args.tiny else "random",
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        kv_cache_memory_bytes=4 << 30 if torch.cuda.is_available() else 256 << 20,
        attention_backend=args.attention,
        flashinfer_kernel=args.flashinfer_kernel,
        fused_kernels=args.fused_kernels,
        gate_up_kernel=args.gate_up_kernel,
        rope_store_kernel=args.rope_store_kernel,
        splitk_norm_kernel=args.splitk_norm_kernel,
        decode=DecodeGraphConfig(enabled=False),
        # one rank serves every backend of the run: `--prefill-schedule auto` is chosen for the
        # first of them, as the service chooses it for its --prefill-backend
        graph=GraphConfig(args.backends.split(",")[0]),
        # named only when asked for, so that an A/B arm of an older tree (no such field) runs
        **({"prefill_schedule": args.prefill_schedule} if args.prefill_schedule != "auto" else {}),
    )
    buckets = tuple(int(b) for b in args.buckets.split(",")) if args.buckets else None
    rows: dict[int, dict] = {}
    refs: dict[int, torch.Tensor] = {}  # eager logits per bucket, the reference of every backend
    captures: dict[str, dict] = {}
    rates = None
    worker = None
    speeds: dict[str, dict] = {}  # this process's host speed: at start, after each backend
    cuda = torch.cuda.is_available()
    if args.profile is not None and not cuda:
        print(f"--profile {args.profile}: no CUDA device, no kernels to list; not profiled")
    count_buckets = {int(b) for b in args.kernel_count_buckets.split(",") if b.strip()}
    timeline_buckets = {int(b) for b in args.timeline.split(",") if b.strip()}
    steps_buckets = {int(b) for b in args.host_steps.split(",") if b.strip()}
    clocks = ClockSampler().start() if cuda else ClockSampler()
    with torch.inference_mode():
        for backend in args.backends.split(","):
            graph = GraphConfig(backend, buckets)
            if worker is None:  # one model for all backends: same weights, a runner each
                worker = RankWorker(set_up_rank(base))
                rates = device_rates(worker.device, clocks)
                speeds["start"] = host_speed(worker.device)
            info = worker.info
            plan = graph.plan(
                context_length=info.context_length,
                pool=ResolvedRequestPool(info.max_running_requests),
                max_prefill_tokens=info.chunked_prefill_size,
            )
            worker.build_runners(plan, DecodePlan((), info.max_running_requests))
            gc.collect()  # the previous backend's graphs must be gone before measuring
            if worker.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            t0 = time.perf_counter()
            mem0 = torch.cuda.memory_reserved() if worker.device.type == "cuda" else 0
            free0 = torch.cuda.mem_get_info()[0] if worker.device.type == "cuda" else 0
            if args.stacks_every > 0:
                faulthandler.dump_traceback_later(args.stacks_every, repeat=True)
            stats = []
            try:
                for b in sorted(plan.bucket_sizes, reverse=True):
                    tb = time.perf_counter()
                    stats.append(worker.capture("prefill", b))
                    print(f"captured {backend} {b}: {time.perf_counter() - tb:.2f} s", flush=True)
            finally:
                faulthandler.cancel_dump_traceback_later()
            total_s = time.perf_counter() - t0
            extra = (free0 - torch.cuda.mem_get_info()[0]) if worker.device.type == "cuda" else 0
            failed = [str(s) for s in stats if not isinstance(s, CaptureStat)]
            captures[backend] = {
                "seconds": round(total_s, 2),
                "extra_device_bytes": extra,
                "reserved_growth_bytes": (torch.cuda.memory_reserved() - mem0) if mem0 else 0,
                "num_buckets": len(stats) - len(failed),
                "failed": failed,
                "tape": tape_steps(worker.runner),
            }
            for stat in stats:
                if not isinstance(stat, CaptureStat):
                    continue
                b = stat.num_tokens
                lens = list(partition_bucket(b, args.context_length))
                batch = real_batch(worker, lens)
                decision = decide_replay(plan, b, len(lens))
                graph_step = logits_step(worker, worker.runner, batch, decision)
                eager_step = logits_step(worker, worker.eager_runner, batch, decision)

                row = rows.setdefault(b, {"bucket": b, "requests": len(lens)})
                if "floor_ms" not in row:
                    flops = prefill_flops(worker.model.cfg, lens)
                    weight_bytes = sum(
                        p.numel() * p.element_size() for p in worker.model.parameters()
                    )
                    copy_bw, mm_rate = rates["copy"], rates["matmul"]
                    row["floor_ms"] = (
                        max(weight_bytes / copy_bw, flops / mm_rate) * 1e3 if copy_bw else None
                    )
                    if copy_bw:  # the same floor at the burst matmul rate, for comparison
                        burst = max(weight_bytes / copy_bw, flops / rates["matmul_burst"])
                        row["floor_burst_ms"] = burst * 1e3
                    refs[b] = eager_step()
                    if cuda and b in count_buckets:
                        row["eager_kernels"], row["eager_busy_ms"] = device_profile(eager_step)
                        row["eager_host_ms"] = host_ms(eager_step, args.iters)
                    if cuda and b in timeline_buckets:
                        row["eager_timeline"] = timeline(eager_step).to_json()
                # graph and eager timed alternately, with the SM clock each ran at; the
                # scheduler's counters say whether the main thread had its CPU meanwhile
                watch, loops = ThreadWatch().start(), []
                both = paired({"eager": eager_step, backend: graph_step}, worker.device,
                              args.iters, clocks, host_loop=loops)  # fmt: skip
                row[f"{backend}_threads"] = {**watch.stop(), "python_loop_us": loops}
                row[f"{backend}_ms"], row[f"{backend}_mhz"] = both[backend]
                row[f"{backend}_eager_ms"], row[f"{backend}_eager_mhz"] = both["eager"]
                row.setdefault("eager_ms", row[f"{backend}_eager_ms"])  # the first backend's
                if cuda and b == args.kernel_diff:
                    kernel_diff(f"{backend} bucket {b}", kernel_times(eager_step),
                                kernel_times(graph_step))  # fmt: skip
                if cuda and b in count_buckets:
                    row[f"{backend}_kernels"], row[f"{backend}_busy_ms"] = device_profile(
                        graph_step
                    )
                    row[f"{backend}_host_ms"] = host_ms(graph_step, args.iters)
                if cuda and b in timeline_buckets:
                    row[f"{backend}_timeline"] = timeline(graph_step).to_json()
                if b in steps_buckets:
                    steps = host_steps(worker.runner, batch, b, args.iters)
                    if steps is not None:
                        # the replans' ops timed alone, once (not for the every-hook row)
                        steps.update(replan_ops(worker.runner, b, args.iters))
                        row[f"{backend}_host_steps"] = steps
                        row[f"{backend}_plan_lines"] = line_costs(
                            worker.runner, batch, b, args.iters
                        )
                        if checks_hooks(worker.runner, b):  # what the check saves, beside
                            row[f"{backend}_host_steps_every_hook"] = host_steps(
                                worker.runner, batch, b, args.iters, ask_every_hook=True
                            )
                        # the host waiting in a Python loop, not in the driver, between replays
                        row[f"{backend}_host_steps_poll"] = host_steps(
                            worker.runner, batch, b, args.iters, wait="poll"
                        )
                if b == args.profile and cuda:  # the CUDA profiler's kernels
                    profile(f"{backend} bucket {b}", graph_step, args.profile_rows)
                    if f"eager_profiled_{b}" not in row:
                        row[f"eager_profiled_{b}"] = True
                        profile(f"eager bucket {b}", eager_step, args.profile_rows)
                if b == args.host_profile and cuda:
                    host_profile(f"{backend} bucket {b}", graph_step)
                    if f"eager_host_profiled_{b}" not in row:
                        row[f"eager_host_profiled_{b}"] = True
                        host_profile(f"eager bucket {b}", eager_step)
                out = graph_step()
                row[f"{backend}_maxdiff"] = float((out - refs[b]).abs().max())
                row[f"{backend}_capture_s"] = round(stat.seconds, 3)
                row[f"{backend}_capture_mib"] = round(stat.memory_bytes / 2**20, 1)
            speeds[backend] = host_speed(worker.device)
            worker.runner = worker.eager_runner  # release this backend's graphs
            if worker.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()

    clocks.stop()
    print(f"SM clocks sampled by: {clocks.source}")
    hf: dict = {}
    backends = args.backends.split(",")
    # per backend: ms, ratio to the floor, kernels per forward
    head = f"{'bucket':>6} {'reqs':>4} {'floor':>7} {'eager':>8} {'/fl':>5} {'kern':>5}"
    head += "".join(f" {b[:10]:>10} {'/fl':>5} {'kern':>5}" for b in backends)
    print(head)
    for b in sorted(rows):
        r = rows[b]
        fl = r.get("floor_ms")

        def cell(ms, kernels, width=8, fl=fl):
            ratio = f"{ms / fl:>5.2f}" if fl and ms else f"{'-':>5}"
            kern = f"{kernels:>5.0f}" if kernels else f"{'-':>5}"
            return f" {ms:>{width}.2f} {ratio} {kern}" if ms else f" {'-':>{width}} {ratio} {kern}"

        line = f"{r['bucket']:>6} {r['requests']:>4} " + (f"{fl:>7.2f}" if fl else f"{'-':>7}")
        line += cell(r["eager_ms"], r.get("eager_kernels"))
        for be in backends:
            line += cell(r.get(f"{be}_ms"), r.get(f"{be}_kernels"), 10)
        print(line)
    if any(r.get("floor_burst_ms") for r in rows.values()):
        # the table's "/fl" is against the sustained floor; small buckets run at full clocks,
        # where the burst floor is the one to meet (the two are equal while weights bound it)
        print("ratio to the burst floor (the matmul rate of an idle GPU)")
        print(f"{'bucket':>6} {'burst':>7}" + "".join(f" {b[:12]:>12}" for b in backends))
        for b in sorted(rows):
            r, fb = rows[b], rows[b].get("floor_burst_ms")
            if not fb:
                continue
            cells = "".join(f" {r[f'{be}_ms'] / fb:>12.2f}" if r.get(f"{be}_ms") else f" {'-':>12}"
                            for be in backends)  # fmt: skip
            print(f"{b:>6} {fb:>7.2f}" + cells)
    print("graph / eager, timed alternately in one stretch (SM MHz graph / eager)")
    print(f"{'bucket':>6}" + "".join(f" {b[:12]:>22}" for b in backends))
    for b in sorted(rows):
        r, cells = rows[b], ""
        for be in backends:
            if f"{be}_eager_ms" not in r:
                cells += f" {'-':>22}"
                continue
            mhz, emhz = r[f"{be}_mhz"], r[f"{be}_eager_mhz"]
            clk = f"{mhz:>5.0f}/{emhz:<5.0f}" if mhz and emhz else f"{'-':>11}"
            cells += f" {r[f'{be}_ms'] / r[f'{be}_eager_ms']:>9.3f} {clk:>12}"
        print(f"{b:>6}" + cells)
    # where a call's time goes: device busy (kernels, copies) vs host issue time
    print("ms per call: event time / device busy / host issue (buckets with kernel counts)")
    print(f"{'bucket':>6}" + "".join(f" {b[:12]:>22}" for b in ["eager", *backends]))
    for b in sorted(rows):
        r = rows[b]
        if "eager_busy_ms" not in r:
            continue
        cells = ""
        for be in ["eager", *backends]:
            if f"{be}_busy_ms" in r:
                ms, busy, host = r[f"{be}_ms"], r[f"{be}_busy_ms"], r[f"{be}_host_ms"]
                cells += f" {ms:>6.2f} /{busy:>6.2f} /{host:>6.2f}"
            else:
                cells += f" {'-':>22}"
        print(f"{b:>6}" + cells)
    if timeline_buckets:
        print("one call on the profiler's clock, us from its start (medians of 5 profiled calls)")
        print(f"{'bucket':>6} {'runner':>12} {TIMELINE_HEADER}")
        for b in sorted(rows):
            for be in ["eager", *backends]:
                if f"{be}_timeline" in rows[b]:
                    t = Timeline(**rows[b][f"{be}_timeline"])
                    print(f"{b:>6} {be[:12]:>12} {timeline_row(t)}")
                    if be != "eager" and t.where:
                        print(f"{'':>6} {'':>12} longest gaps: {t.where}")
    if steps_buckets:
        print("a segment runner's replay step by step on the host, unprofiled (median us)")
        print(STEPS_HEADER)
        for b in sorted(rows):
            for be in backends:
                if f"{be}_host_steps" in rows[b]:
                    print(steps_row(be, b, rows[b][f"{be}_host_steps"]))
                    if ops := ops_row(rows[b][f"{be}_host_steps"]):
                        print(ops)
                for where, us in rows[b].get(f"{be}_plan_lines", []):
                    print(f"{'':>20} {us:>6.1f}  {where}")
                if f"{be}_host_steps_every_hook" in rows[b]:  # each hook asked: the old path
                    print(steps_row(f"{be[:9]} all", b, rows[b][f"{be}_host_steps_every_hook"]))
                if rows[b].get(f"{be}_host_steps_poll"):  # waited in Python between replays
                    print(steps_row(f"{be[:8]} poll", b, rows[b][f"{be}_host_steps_poll"]))
    print("this process's host (benchmarks/host_speed.py), at start and after each backend:")
    for when, speed in speeds.items():
        print(f"  {when}: {speed_line(speed)}")
    print("the main thread while each bucket was timed (graph and eager, scheduler counters):")
    for b in sorted(rows):
        for be in backends:
            if f"{be}_threads" in rows[b]:
                w = rows[b][f"{be}_threads"]
                loops = "/".join(f"{v:.0f}" for v in w.get("python_loop_us", []))
                print(f"  {b:>6} {be[:12]:>12}: loop {loops} us; {summary(w)}")
    for be, c in captures.items():
        print(
            f"capture {be}: {c['num_buckets']} buckets in {c['seconds']} s, "
            f"{c['extra_device_bytes'] / 2**20:.0f} MiB extra device memory, failed {c['failed']}"
            + (f"; tape of the largest bucket: {c['tape']}" if c.get("tape") else "")
        )
    print(f"attention: {info.attention.name} ({info.attention.reason})")
    print(f"fused kernels: {info.kernels.name} ({info.kernels.reason})")
    print(f"gate_up kernel: {info.gate_up.name} ({info.gate_up.reason})")
    print(f"rope_store kernel: {info.rope_store.name} ({info.rope_store.reason})")
    print(f"splitk_norm kernel: {info.splitk_norm.name} ({info.splitk_norm.reason})")
    schedule = getattr(info, "prefill_schedule", None)  # an A/B arm's older tree may lack it
    if schedule is not None:
        print(f"prefill schedule, every backend: {schedule.name} ({schedule.reason})")
    if rates and rates["copy"]:
        print(
            f"measured: copy {rates['copy'] / 1e12:.2f} TB/s, bf16 matmul sustained "
            f"{rates['matmul'] / 1e12:.0f} TFLOP/s at {rates['matmul_mhz'] or 0:.0f} MHz (the "
            f"floor's), burst {rates['matmul_burst'] / 1e12:.0f} TFLOP/s at "
            f"{rates['matmul_burst_mhz'] or 0:.0f} MHz (the fastest product of {BURSTS} bursts; "
            f"their medians "
            + "/".join(f"{v / 1e12:.0f}" for v in rates.get("matmul_burst_medians", []))
            + ")"
        )

    def save() -> None:
        if args.out:
            Path(args.out).write_text(
                json.dumps({"rows": [rows[b] for b in sorted(rows)], "captures": captures,
                            "copy_bytes_per_s": rates["copy"], "matmul_flops": rates["matmul"],
                            "rates": rates, "host_speed": speeds,
                            "device": torch.cuda.get_device_name()
                            if worker.device.type == "cuda" else "cpu",
                            "attention": info.attention.to_json(),
                            "fused_kernels": info.kernels.to_json(),
                            "gate_up_kernel": info.gate_up.to_json(),
                            "rope_store_kernel": info.rope_store.to_json(),
                            "splitk_norm_kernel": info.splitk_norm.to_json(), "hf_compiled_ms": hf,
                            "torch": torch.__version__, "args": vars(args)}, indent=2)
            )  # fmt: skip

    save()  # before the reference model: a call cut short keeps our own figures
    for tokens in [int(t) for t in args.hf_compiled.split(",") if t.strip()]:
        hf[tokens] = hf_compiled_ms(QWEN25_15B, tokens, args.iters)
        gc.collect()  # the reference model and its graph go before the next
        torch.cuda.empty_cache()
        print(f"hf compiled + cuda graph, {tokens} tokens: {hf[tokens]:.2f} ms", flush=True)
        save()
    print("the prefill-floor issue's targets, this process's figures (benchmarks/targets.py)")
    print(report(verdicts([rows[b] for b in sorted(rows)], backends, hf)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
