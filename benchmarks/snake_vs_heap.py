"""How the device planner's schedule (sm90_balance.planned: the snake) compares with FlashInfer's
own SM90 schedule (its heap: each item, longest request first, to the least loaded CTA; modelled
by tests/test_sm90_balance.flashinfer_plan) on random prefills with more items than CTAs: the
busiest CTA's cost (the kernel's cost model) of each, per layout. CPU only, numpy:

    PYTHONPATH=. python benchmarks/snake_vs_heap.py --trials 3000
"""

from __future__ import annotations

import argparse

import numpy as np

from service.ranks.attention.sm90_balance import item_costs, makespan, planned
from tests.test_sm90_balance import flashinfer_plan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3000)
    ap.add_argument("--ctas", type=int, default=132)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ratios, worst = [], (0.0, None)
    for _ in range(args.trials):
        bucket = int(rng.choice([1024, 2048, 4096, 8192]))
        slots = int(rng.integers(1, 9))
        cuts = np.sort(rng.integers(0, bucket, slots - 1))
        lens = [int(x) for x in np.diff(np.r_[0, cuts, bucket]) if x > 0]
        heads = int(rng.choice([12, 16, 32]))
        ours = planned(np.array(lens), heads, args.ctas)
        if ours.block.shape[1] <= args.ctas:
            continue  # at most one item per CTA: FlashInfer's plan is kept there
        mine = makespan(item_costs(ours.block[0], ours.block[3], ours.block[4]), ours.work_indptr)
        r = mine / makespan(*flashinfer_plan(lens, heads, args.ctas))
        ratios.append(r)
        if r > worst[0]:
            worst = (r, (lens, heads))
    a = np.array(ratios)
    print(f"layouts with more items than {args.ctas} CTAs: {len(a)}")
    print(f"planner's busiest CTA / FlashInfer's: median {np.median(a):.3f}, "
          f"best {a.min():.3f}, worst {a.max():.3f} ({worst[1]})")  # fmt: skip
    longer, equal, shorter = (a > 1).sum(), (a == 1).sum(), (a < 1).sum()
    print(f"planner longer in {longer}, equal in {equal}, shorter in {shorter}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
