"""One line per prefill_graphs result: the host's Python loop at start and, per bucket and
backend, the replay's ms beside the loop's median while it was timed (host_speed). Used by
gpu_run.sh's ``ab`` and ``pad`` steps: each process's times beside the host speed it ran at.

    python benchmarks/loop_summary.py LABEL result.json [LABEL result.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def line(label: str, result: dict) -> str:
    start = result.get("host_speed", {}).get("start", {})
    cells = []
    for row in result["rows"]:
        for key, ms in row.items():
            backend = key.removesuffix("_ms")
            if not key.endswith("_ms") or f"{backend}_threads" not in row:
                continue
            loops = row[f"{backend}_threads"].get("python_loop_us") or [float("nan")]
            cells.append(
                f"{backend} {row['bucket']}: {ms:.3f} ms (eager {row[f'{backend}_eager_ms']:.2f}), "
                f"loop {statistics.median(loops):.0f} us"
            )
    loop0 = start.get("python_loop_us", float("nan"))
    return f"{label:>12} start loop {loop0:.0f} us | " + " | ".join(cells)


def main(argv: list[str]) -> int:
    for label, path in zip(argv[::2], argv[1::2], strict=True):
        print(line(label, json.loads(Path(path).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
