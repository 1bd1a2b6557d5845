"""Host-side costs of the serving loop that do not need a GPU (docs/benchmarks.md, "Serving").

    python benchmarks/host_costs.py layouts        # per-step host layouts, 32 decode requests
    python benchmarks/host_costs.py first-prefill  # first prefills after start-up, gc frozen or not
    python benchmarks/host_costs.py replan         # a later plan's own host work (RaggedReplan)
    python benchmarks/host_costs.py load           # a replay's copy into the static buffers
    python benchmarks/host_costs.py tracer         # what host_steps.line_costs adds to a line

``layouts`` times the per-step host work of a decode step of 32 requests with 300-331 cached
tokens each: FlashInfer's paged layout, the batch's tensors, the request-row writes (CPU
tensors; on CUDA the same code also copies once to the device). Run it with another tree's
``service`` first on PYTHONPATH to compare (``PYTHONPATH=abtest/old python
benchmarks/host_costs.py layouts``).

``first-prefill`` builds the built-in-shaped micro model (1 layer, hidden 64, random weights)
in-process and times four 256-token prefills, three ways: as start-up leaves the heap, after a
``gc.collect()``, and after ``gc.collect(); gc.freeze()`` (service.heap, what the server does).
Each way runs in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# benchmarks.host_steps for ``tracer``; appended, so that a ``service`` first on PYTHONPATH
# (another tree, for an A/B) is the one imported
sys.path.append(str(Path(__file__).resolve().parents[1]))

MICRO = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 384, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
}  # fmt: skip


def per_call_us(fn, n: int = 500) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def layouts() -> None:
    import torch

    from service.ranks.attention.paged_layout import paged_layout
    from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
    from service.ranks.kv_pool import ReqToTokenPool

    b = 32
    layout = BatchLayout(ForwardMode.DECODE, tuple(range(b)), tuple(300 + i for i in range(b)),
                         (1,) * b)  # fmt: skip
    pool = ReqToTokenPool(64, 2048, torch.device("cpu"))
    cpu = torch.device("cpu")
    rows = {
        "paged layout": per_call_us(lambda: paged_layout(layout, 2048, b)),
        "batch tensors": per_call_us(
            lambda: ForwardBatch.build(layout, list(range(b)), list(range(b)), cpu)
        ),
        "row writes": per_call_us(lambda: pool.write_many([(i, 300 + i, [5]) for i in range(b)])),
    }
    for name, us in rows.items():
        print(f"{name:>14}: {us:7.1f} us")


def _stand_in_replan():  # a RaggedReplan and its lengths
    """A RaggedReplan of 8 slots on CPU tensors after its first plan, with a stand-in module
    call that returns at once, and the lengths of one request of 256 tokens."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from service.ranks.attention.flashinfer_replan import RaggedReplan

    slots = 8
    indptrs = torch.zeros(2, slots + 1, dtype=torch.int32)
    info = [3, 1, 4]

    class Wrapper:  # FlashInfer's CUDA-graph ragged wrapper, as far as a plan goes
        def plan(self, qo: torch.Tensor) -> None:
            self._cached_module = module
            kv = qo.to("cpu")
            indptrs.copy_(torch.stack([qo, qo]))
            self._plan_info = module.plan("ws", qo, kv, kv[1:] - kv[:-1], 64, slots)

    module = SimpleNamespace(plan=lambda *args: list(info))
    w = Wrapper()
    r = RaggedReplan(w, indptrs, w.plan)
    lens = np.zeros(slots, dtype=np.int64)
    lens[0] = 256
    r(lens)  # the first plan: recorded
    if not getattr(r, "_call", None):
        raise SystemExit("the replan did not record the stand-in's module call")
    return r, lens


def replan() -> None:
    """A later plan of RaggedReplan (``full``'s and the segment backends' per-replay plan) on
    CPU tensors, 8 slots, one request of 256 tokens, with a stand-in module call that returns at
    once: the replan's own host work (the host indptrs, the copy call, the info check), without
    FlashInfer or a device. Medians of 10 rounds of 5,000 calls."""
    import statistics

    r, lens = _stand_in_replan()
    rounds = [per_call_us(lambda: r(lens), 5000) for _ in range(10)]
    print(f"replan, 8 slots: {statistics.median(rounds):.2f} us (median of 10 rounds; "
          f"min {min(rounds):.2f})")  # fmt: skip


def tracer() -> None:
    """How much ``host_steps.line_costs``'s line tracer adds to a traced line whose callee runs
    Python: the stand-in replan's module-call line, its callee first running torch's device
    lookup (``torch.cuda._utils._get_device_index(None, optional=True)``, 15 Python frames: part
    of what ``torch.cuda.Event.record()`` without a stream runs, through ``current_stream``),
    traced against the same call untraced. Untraced: medians of 10 rounds of 5,000 calls;
    traced: line_costs over 2,000 replays."""
    import statistics

    from torch.cuda._utils import _get_device_index

    from benchmarks.host_steps import line_costs, plan_only_runner

    r, lens = _stand_in_replan()
    call = r._call

    def with_lookup() -> object:
        _get_device_index(None, optional=True)
        return call()

    runner = plan_only_runner(r, lens, len(lens))
    for name, fn in (("the module call alone", call), ("with torch's device lookup", with_lookup)):
        r._call = fn
        untraced = statistics.median(per_call_us(fn, 5000) for _ in range(10))
        lines = dict(line_costs(runner, None, 256, iters=2000, top=20))
        traced = next(us for where, us in lines.items() if "self._call()" in where)
        print(f"{name:>28}: untraced {untraced:5.2f} us, its line traced {traced:5.2f} us")


def load() -> None:
    """A replay's copy of a live batch into the static buffers on CPU tensors, the same batch
    again and again (serving's steady state at one size): prefill's token rows
    (``copy_tokens``, the segment backends' load) for 200 and 256 tokens into bucket 256, and a
    decode step's (``DecodeStaticBuffers.copy_from``) for 3 and 4 requests into size 4. The
    copy's own host work, and how many device ops it makes (copies and fills). Medians of 10
    rounds of 5,000 calls."""
    import statistics

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from service.ranks.forward_batch import BatchLayout, ForwardBatch, ForwardMode
    from service.ranks.runners.decode import DecodeStaticBuffers
    from service.ranks.runners.static_buffers import PrefillStaticBuffers

    writes = {torch.ops.aten.copy_.default, torch.ops.aten.fill_.Scalar,
              torch.ops.aten.zero_.default}  # fmt: skip

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in writes
            return func(*args, **(kwargs or {}))

    def report(name: str, copy: Any) -> None:
        copy()
        with Ops() as mode:
            copy()
        rounds = [per_call_us(copy, 5000) for _ in range(10)]
        print(f"{name}: {statistics.median(rounds):.2f} us (median of 10 rounds; "
              f"min {min(rounds):.2f}), {mode.n} device ops")  # fmt: skip

    cpu = torch.device("cpu")
    bufs = PrefillStaticBuffers.allocate(8192, 64, cpu)
    for n in (200, 256):
        layout = BatchLayout(ForwardMode.EXTEND, (0,), (0,), (n,))
        batch = ForwardBatch.build(layout, list(range(n)), list(range(n)), cpu)
        report(f"copy_tokens, {n} tokens into 256", lambda b=batch: bufs.copy_tokens(b, 256))
    dec = DecodeStaticBuffers.allocate(64, cpu)
    for b in (3, 4):
        layout = BatchLayout(ForwardMode.DECODE, tuple(range(b)), (300,) * b, (1,) * b)
        batch = ForwardBatch.build(layout, list(range(b)), list(range(1, b + 1)), cpu)
        report(f"decode copy_from, {b} requests into 4", lambda x=batch: dec.copy_from(x, 4))


def first_prefill_child(mode: str, model_dir: str) -> None:
    import gc

    from service.config import EngineConfig
    from service.engine import Engine
    from service.sampling import SamplingParams

    e = Engine(EngineConfig(model_path=model_dir, load_format="random", executor="local",
                            context_length=2048, max_running_requests=64))  # fmt: skip
    if mode != "as-is":
        gc.collect()
    if mode == "frozen":
        gc.freeze()
    times = []
    for _ in range(4):
        r = e.add(list(range(1, 257)), SamplingParams(max_new_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        while not r.finished:
            e.step()
        times.append(round((time.perf_counter() - start) * 1e3, 1))
    print(json.dumps(times))


def first_prefill() -> None:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(MICRO))
        for mode in ("as-is", "collected", "frozen"):
            out = subprocess.run(
                [sys.executable, __file__, "_child", mode, d],
                capture_output=True, text=True, check=True,
            ).stdout.strip().splitlines()[-1]  # fmt: skip
            print(f"{mode:>9}: 256-token prefills, ms: {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "what", choices=["layouts", "replan", "load", "tracer", "first-prefill", "_child"]
    )
    p.add_argument("args", nargs="*")
    a = p.parse_args()
    if a.what == "layouts":
        layouts()
    elif a.what == "replan":
        replan()
    elif a.what == "load":
        load()
    elif a.what == "tracer":
        tracer()
    elif a.what == "first-prefill":
        first_prefill()
    else:
        first_prefill_child(*a.args)


if __name__ == "__main__":
    main()
