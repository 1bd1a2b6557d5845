"""The SM90 schedule's device kernels (service.ranks.attention.sm90_triton) under Triton's
interpreter, on a CPU: the rewrite against the host rewrite (the same bytes for random batches
and for the start-up probe's plan), and the planner against sm90_balance.planned (the same
arrays for random request slots). A check for a machine without a GPU (it needs triton
installed, which the CPU install does not carry), not a timing:

    pip install --target /tmp/trisite --no-deps triton==3.5.0
    PYTHONPATH=/tmp/trisite:. python benchmarks/sm90_interpret.py --batches 60

Triton 3.5.0's interpreter turns a scalar into an index with ``int()`` of a one-element array,
which numpy 2.4 refuses; this script wraps the interpreter's tensor patch to take the element.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch


def _interpreter_takes_numpy_2_4() -> None:
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor) -> None:
        patch(tensor)
        tensor.__index__ = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])

    interpreter._patch_lang_tensor = patched


def same_bytes(
    items: np.ndarray, work_indptr: np.ndarray, ctas: int, spare: int
) -> tuple[bool, bool]:
    """(the host rewrite dealt the plan again, the kernel wrote the host rewrite's bytes)."""
    from service.ranks.attention import sm90_triton
    from service.ranks.attention.sm90_schedule import LaidOutPlan, Layout, SM90Rebalance

    cpu = torch.device("cpu")
    host, dev = (LaidOutPlan(items, work_indptr, cpu, spare) for _ in range(2))
    dealt = SM90Rebalance(cpu, num_ctas=ctas)(host, 128)
    layout = Layout.of(dev._plan_info, ctas)
    region = dev._int_workspace_buffer.view(torch.int32)[layout.start : layout.end]
    tmp = torch.zeros(sm90_triton.scratch_size(layout.capacity, ctas), dtype=torch.int32)
    sm90_triton.deal(
        region.clone(), region, tmp, layout.capacity, layout.at["work_indptr"] - layout.start,
        layout.at["batch"] - layout.start, ctas, 128,
    )  # fmt: skip
    return dealt, torch.equal(host._int_workspace_buffer, dev._int_workspace_buffer)


def same_plan(lengths: list[int], heads: int, ctas: int, slack: int) -> bool:
    """Whether the planner wrote sm90_balance.planned's arrays into a region laid out as
    FlashInfer's (``slack`` spare items per array), and nothing else."""
    from service.ranks.attention.sm90_schedule import planner_bytes

    return torch.equal(*planner_bytes(lengths, heads, ctas, torch.device("cpu"), slack))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=60, help="random batches")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run in numpy
    _interpreter_takes_numpy_2_4()
    from service.ranks.attention.sm90_schedule import probe_items
    from tests.test_sm90_balance import flashinfer_items

    rng = np.random.default_rng(args.seed)
    counts = {"dealt": 0, "kept": 0, "differ": 0}
    for _ in range(args.batches):
        lens = [int(x) for x in rng.integers(1, 3000, size=rng.integers(1, 5))]
        ctas = int(rng.choice([3, 8, 16, 33, 132]))
        heads = int(rng.integers(1, 6))
        dealt, same = same_bytes(
            *flashinfer_items(lens, heads, ctas), ctas, int(rng.integers(0, 9))
        )
        counts["dealt" if dealt else "kept"] += 1
        if not same:
            counts["differ"] += 1
            print(f"differ: lengths {lens}, {heads} heads, {ctas} CTAs", flush=True)
    print(f"random batches: {args.batches}, {counts}")
    for ctas in (132, 78, 16):
        dealt, same = same_bytes(*probe_items(ctas), ctas, 3)
        print(f"probe plan, {ctas} CTAs: host rewrite dealt it {dealt}, same bytes {same}")
        counts["differ"] += not (dealt and same)
    planned = {"same": 0, "differ": 0}
    for _ in range(args.batches):
        slots = int(rng.integers(1, 9))
        lens = [int(x) * int(rng.random() < 0.8) for x in rng.integers(1, 3000, size=slots)]
        if rng.random() < 0.3:  # lengths on tile edges: equal costs across requests
            lens = [128 * int(rng.integers(0, 9)) for _ in range(slots)]
        ctas, heads = int(rng.choice([3, 8, 16, 33, 132])), int(rng.integers(1, 13))
        ok = same_plan(lens, heads, ctas, int(rng.integers(0, 9)))
        planned["same" if ok else "differ"] += 1
        if not ok:
            print(f"planner differs: lengths {lens}, {heads} heads, {ctas} CTAs", flush=True)
    for lens in ([2048], [0, 0, 0], [1000, 0, 700, 348], [128, 256, 128, 384]):
        ok = same_plan(lens, 12, 132, 3)
        planned["same" if ok else "differ"] += 1
        print(f"planner, lengths {lens}: same arrays {ok}")
    print(f"planner: {planned}")
    return 1 if counts["differ"] or planned["differ"] else 0


if __name__ == "__main__":
    sys.exit(main())
