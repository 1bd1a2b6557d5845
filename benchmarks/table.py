"""Markdown tables of a `prefill_graphs.py --out` result, for docs/benchmarks.md.

python benchmarks/table.py results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(path: str) -> int:
    d = json.loads(Path(path).read_text())
    rows = d["rows"]
    backends = [b for b in ("full", "breakable", "tc_piecewise") if f"{b}_ms" in rows[0]]
    head = ["bucket", "requests", "eager ms"]
    for b in backends:
        head += [f"{b} ms", f"{b} x"]
    head += ["floor ms"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for r in rows:
        cells = [str(r["bucket"]), str(r["requests"]), f"{r['eager_ms']:.2f}"]
        for b in backends:
            ms = r.get(f"{b}_ms")
            cells += [f"{ms:.2f}", f"{r['eager_ms'] / ms:.2f}"] if ms else ["-", "-"]
        cells.append(f"{r['floor_ms']:.2f}" if r.get("floor_ms") else "-")
        print("| " + " | ".join(cells) + " |")
    print()
    head = ["bucket"] + [f"{b} capture s / MiB" for b in backends]
    head += [f"{b} max abs logit diff" for b in backends]
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for r in rows:
        cells = [str(r["bucket"])]
        cells += [f"{r[f'{b}_capture_s']:.3f} / {r[f'{b}_capture_mib']:.0f}" for b in backends]
        cells += [f"{r[f'{b}_maxdiff']:.3f}" for b in backends]
        print("| " + " | ".join(cells) + " |")
    print()
    for b, c in d["captures"].items():
        print(
            f"- capture {b}: {c['num_buckets']} buckets in {c['seconds']} s, "
            f"{c['extra_device_bytes'] / 2**20:.0f} MiB extra device memory"
        )
    print(
        f"- measured: copy {d['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
        f"{d['matmul_flops'] / 1e12:.0f} TFLOP/s; attention {d['attention']['name']}; "
        f"{d['device']}, torch {d['torch']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
