"""A time series of the host's speed while other benchmarks run: every ``--every`` seconds, the
pure-Python loop of host_speed (median µs), the CPU it ran on and the hypervisor's steal time
since the last sample, one line each, until killed or ``--seconds`` pass.

Why: the loop's time flips between two levels (about 39 and 70-95 µs on the H100 machines of
session 49) within and between processes, unrelated to the code running; a second process that
watches tells whether a benchmark process's slow host was the machine's state at that moment.

    python benchmarks/host_watch.py --seconds 300 > host_watch.txt &
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.host_speed import current_cpu, python_loop_us, steal_ticks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--every", type=float, default=0.5)
    ap.add_argument("--seconds", type=float, default=600.0)
    args = ap.parse_args()
    t0 = time.time()
    last = steal_ticks()
    while time.time() - t0 < args.seconds:
        loop = python_loop_us(9, 5)
        cpu = current_cpu()
        steal = steal_ticks()
        stolen = (steal.get("cpu", 0) - last.get("cpu", 0)) * 10
        last = steal
        print(f"{time.time():.1f} loop {loop:.1f} us cpu {cpu} steal {stolen} ms", flush=True)
        time.sleep(args.every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
