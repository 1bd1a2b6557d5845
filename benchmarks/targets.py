"""The prefill-floor issue's targets, checked against one `prefill_graphs.py` result.

Why: every GPU call so far was read against the targets by hand, from three tables, with the
floor of the process (it moves by a few percent between processes). This prints, per backend and
bucket, each target that applies, its measured figure and met or missed, from the figures of
one process only:

- at most 3x the burst floor at 256 tokens or fewer, at most 1.4x from 2,048 tokens;
- faster than Hugging Face transformers compiled (+ one CUDA graph) where the same process
  measured it at the bucket's token count;
- never slower than eager, timed alternately with it in one stretch.

    python benchmarks/targets.py results.json      # a saved result (prefill_graphs.py --out)

``prefill_graphs.py`` prints the same check at the end of a run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SMALL_MAX_TOKENS, SMALL_RATIO = 256, 3.0
LARGE_MIN_TOKENS, LARGE_RATIO = 2048, 1.4


@dataclass(frozen=True)
class Verdict:
    backend: str
    bucket: int
    target: str  # what the figure is held to, e.g. "<= 3x floor"
    measured: float  # the figure (a ratio)
    met: bool

    def line(self) -> str:
        return (
            f"{self.backend:>12} {self.bucket:>6}  {self.target:<22} {self.measured:>6.2f}  "
            f"{'met' if self.met else 'MISSED'}"
        )


def verdicts(
    rows: Sequence[Mapping], backends: Sequence[str], hf_ms: Mapping[int, float]
) -> list[Verdict]:
    """Every target that applies to each backend's measured buckets (a pure function of one
    result's rows: ``{backend}_ms``, ``floor_burst_ms`` or ``floor_ms``, ``{backend}_eager_ms``)."""
    out: list[Verdict] = []
    for r in sorted(rows, key=lambda r: r["bucket"]):
        b = int(r["bucket"])
        floor = r.get("floor_burst_ms") or r.get("floor_ms")
        for be in backends:
            ms = r.get(f"{be}_ms")
            if not ms:
                continue
            if floor and b <= SMALL_MAX_TOKENS:
                ratio = ms / floor
                out.append(
                    Verdict(be, b, f"<= {SMALL_RATIO:g}x floor", ratio, ratio <= SMALL_RATIO)
                )
            if floor and b >= LARGE_MIN_TOKENS:
                ratio = ms / floor
                out.append(
                    Verdict(be, b, f"<= {LARGE_RATIO:g}x floor", ratio, ratio <= LARGE_RATIO)
                )
            if b in hf_ms:
                ratio = ms / hf_ms[b]
                out.append(Verdict(be, b, "< 1x HF compiled", ratio, ratio < 1.0))
            eager = r.get(f"{be}_eager_ms")
            if eager:
                ratio = ms / eager
                out.append(Verdict(be, b, "<= 1x eager", ratio, ratio <= 1.0))
    return out


def report(vs: Sequence[Verdict]) -> str:
    missed = [v for v in vs if not v.met]
    head = f"{'backend':>12} {'bucket':>6}  {'target':<22} {'x':>6}"
    lines = [head, *(v.line() for v in vs)]
    lines.append(f"targets: {len(vs) - len(missed)} of {len(vs)} met" + (
        "; missed: " + ", ".join(f"{v.backend} {v.bucket} ({v.target}: {v.measured:.2f})"
                                 for v in missed) if missed else ""))  # fmt: skip
    return "\n".join(lines)


def from_result(d: Mapping) -> list[Verdict]:
    rows = d["rows"]
    backends = [
        b for b in ("full", "breakable", "tc_piecewise") if any(f"{b}_ms" in r for r in rows)
    ]
    hf = {int(k): float(v) for k, v in (d.get("hf_compiled_ms") or {}).items()}
    return verdicts(rows, backends, hf)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/targets.py RESULT.json", file=sys.stderr)
        return 2
    print(report(from_result(json.loads(Path(argv[0]).read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
