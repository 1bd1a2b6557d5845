"""The prefill-floor issue's targets, checked against one `prefill_graphs.py` result.

Why: every GPU call so far was read against the targets by hand, from three tables, with the
floor of the process (it moves by a few percent between processes). This prints, per backend and
bucket, each target that applies, its measured figure and met or missed, from the figures of
one process only:

- at most 3x the burst floor at 256 tokens or fewer, at most 1.4x from 2,048 tokens;
- faster than Hugging Face transformers compiled (+ one CUDA graph) where the same process
  measured it at the bucket's token count;
- never slower than eager, timed alternately with it in one stretch.

Beside each floor target it prints the host's pure-Python loop read before each timing round
(``benchmarks/host_speed.py``, where the result has it) and marks a timing whose median loop ran
at least SLOW_HOST times the fastest of that process: the lent VMs' CPUs run at one of two
speeds (docs/benchmarks.md, sessions 49-50), and the host-bound small buckets follow them.

    python benchmarks/targets.py results.json      # a saved result (prefill_graphs.py --out)

``prefill_graphs.py`` prints the same check at the end of a run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median

SMALL_MAX_TOKENS, SMALL_RATIO = 256, 3.0
LARGE_MIN_TOKENS, LARGE_RATIO = 2048, 1.4
SLOW_HOST = 1.3  # a timing's median loop over the process's fastest round: the slow speed


@dataclass(frozen=True)
class Verdict:
    backend: str
    bucket: int
    target: str  # what the figure is held to, e.g. "<= 3x floor"
    measured: float  # the figure (a ratio)
    met: bool
    host_loop_us: tuple[float, ...] = ()  # the host's loop before each round of this timing
    slow_host: bool = False  # its median at least SLOW_HOST x the process's fastest round

    def line(self) -> str:
        host = ""
        if self.host_loop_us:
            loops = "/".join(f"{v:.0f}" for v in self.host_loop_us)
            host = f"  loop {loops} us" + (", slow host" if self.slow_host else "")
        return (
            f"{self.backend:>12} {self.bucket:>6}  {self.target:<22} {self.measured:>6.2f}  "
            f"{'met' if self.met else 'MISSED'}{host}"
        )


def _loops(row: Mapping, backend: str) -> tuple[float, ...]:
    return tuple((row.get(f"{backend}_threads") or {}).get("python_loop_us") or ())


def verdicts(
    rows: Sequence[Mapping], backends: Sequence[str], hf_ms: Mapping[int, float]
) -> list[Verdict]:
    """Every target that applies to each backend's measured buckets (a pure function of one
    result's rows: ``{backend}_ms``, ``floor_burst_ms`` or ``floor_ms``, ``{backend}_eager_ms``)."""
    out: list[Verdict] = []
    fastest = min((v for r in rows for be in backends for v in _loops(r, be)), default=0.0)
    for r in sorted(rows, key=lambda r: r["bucket"]):
        b = int(r["bucket"])
        floor = r.get("floor_burst_ms") or r.get("floor_ms")
        for be in backends:
            ms = r.get(f"{be}_ms")
            if not ms:
                continue
            loops = _loops(r, be)
            slow = bool(loops) and fastest > 0 and median(loops) >= SLOW_HOST * fastest
            for applies, limit in ((b <= SMALL_MAX_TOKENS, SMALL_RATIO),
                                   (b >= LARGE_MIN_TOKENS, LARGE_RATIO)):  # fmt: skip
                if floor and applies:
                    ratio = ms / floor
                    out.append(Verdict(be, b, f"<= {limit:g}x floor", ratio, ratio <= limit,
                                       loops, slow))  # fmt: skip
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
        "; missed: " + ", ".join(f"{v.backend} {v.bucket} ({v.target}: {v.measured:.2f}"
                                 f"{', slow host' if v.slow_host else ''})"
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
