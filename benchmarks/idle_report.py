"""Where a prefill call's time goes beyond the device's own work, read back from the JSON that
``prefill_graphs.py --out`` saved: no GPU needed.

Per bucket and runner that has kernel counts (``--kernel-count-buckets``): the CUDA-event time,
the device's busy time (kernels, copies, memsets), idle = event - busy, and both against the
burst floor. Per runner with a timeline (``--timeline``): when the first device op started, the
short gaps (device-side boundaries between kernels) and the long ones (the device waiting for
the host), each long gap named by the ops on either side.

Why a script: the targets are ratios of event time to the floor, and whether a miss is the
device's work or the device waiting is the first question for every miss (docs/benchmarks.md,
session 30). The figures quoted there come from this script over the saved results.

    python3 benchmarks/idle_report.py docs/results/prefill-2026-12-04-s29-d-34c47a6.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

RUNNERS = ("eager", "full", "breakable", "tc_piecewise")
# where a gap of Timeline.where starts: "at+length " (then "before->after", each name cut to
# 18 characters, gaps joined by one space)
_GAP_START = re.compile(r"(?:^|\s)(\d+(?:\.\d+)?)\+(\d+(?:\.\d+)?) ")


@dataclass(frozen=True)
class Gap:
    at_us: float  # from the start of the call
    length_us: float
    before: str  # the device op the gap follows
    after: str  # the device op it precedes


@dataclass(frozen=True)
class Idle:
    """One runner at one bucket of one saved call."""

    source: str
    bucket: int
    runner: str
    event_ms: float
    busy_ms: float
    floor_ms: float | None  # the burst floor
    event_mhz: float | None  # the SM clock of the timed calls (busy's calls were not sampled)

    @property
    def idle_ms(self) -> float:
        return self.event_ms - self.busy_ms

    def over_floor(self, ms: float) -> float | None:
        return ms / self.floor_ms if self.floor_ms else None


def parse_gaps(where: str) -> list[Gap]:
    """The gaps of ``Timeline.where`` ("211+125 Memcpy HtoD ->Memcpy HtoD  89+122 ...")."""
    starts = list(_GAP_START.finditer(where))
    gaps = []
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(where)
        before, _, after = where[m.end() : end].partition("->")
        gaps.append(Gap(float(m.group(1)), float(m.group(2)), before.strip(), after.strip()))
    return gaps


def rows_of(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    rows = data.get("rows", data) if isinstance(data, dict) else data
    rows = rows if isinstance(rows, list) else list(rows.values())
    return [r for r in rows if isinstance(r, dict) and "bucket" in r]


def idles(path: Path) -> list[Idle]:
    """Every (bucket, runner) of a saved call with both an event time and a busy time."""
    out = []
    for r in rows_of(path):
        for runner in RUNNERS:
            ms = r.get("eager_ms") if runner == "eager" else r.get(f"{runner}_ms")
            busy = r.get(f"{runner}_busy_ms")
            if ms is None or busy is None:
                continue
            mhz = r.get("full_eager_mhz") if runner == "eager" else r.get(f"{runner}_mhz")
            out.append(Idle(path.name, r["bucket"], runner, ms, busy, r.get("floor_burst_ms"), mhz))
    return out


def _ratio(x: float | None) -> str:
    return f"{x:>6.2f}" if x is not None else f"{'-':>6}"


def report(paths: list[Path], runners: tuple[str, ...]) -> str:
    lines = [
        "event / busy / idle in ms; ratios to the burst floor; MHz of the timed calls",
        f"{'call':<44} {'bucket':>6} {'runner':>12} {'event':>7} {'busy':>7} {'idle':>6} "
        f"{'ev/fl':>6} {'busy/fl':>7} {'MHz':>5}",
    ]
    for path in paths:
        for x in idles(path):
            if x.runner not in runners:
                continue
            mhz = f"{x.event_mhz:>5.0f}" if x.event_mhz else f"{'-':>5}"
            lines.append(
                f"{x.source[:44]:<44} {x.bucket:>6} {x.runner:>12} {x.event_ms:>7.3f} "
                f"{x.busy_ms:>7.3f} {x.idle_ms:>6.3f} {_ratio(x.over_floor(x.event_ms))} "
                f"{_ratio(x.over_floor(x.busy_ms)):>7} {mhz}"
            )
    lines.append(
        "profiled calls (--timeline), us: first device op, short gaps, long gaps; the long ones"
    )
    for path in paths:
        for r in rows_of(path):
            for runner in runners:
                t = r.get(f"{runner}_timeline")
                if not isinstance(t, dict) or t.get("short_gaps_us") is None:
                    continue  # timelines before session 26 did not split the gaps
                lines.append(
                    f"{path.name[:44]:<44} {r['bucket']:>6} {runner:>12} first op "
                    f"{t['first_op_us']:>6.1f}, short {t['short_gaps_us']:>6.1f}, long "
                    f"{t['long_gaps_us']:>7.1f} ({t['long_gaps']:.0f})"
                )
                for g in sorted(parse_gaps(t.get("where", "")), key=lambda g: g.at_us):
                    lines.append(
                        f"{'':>64} {g.length_us:>6.1f} at {g.at_us:>6.1f}: "
                        f"{g.before[:24]} -> {g.after[:24]}"
                    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="prefill_graphs.py --out JSON files")
    p.add_argument("--runners", default="full,breakable,tc_piecewise",
                   help=f"comma-separated, of {', '.join(RUNNERS)}")  # fmt: skip
    args = p.parse_args(argv)
    runners = tuple(r for r in args.runners.split(",") if r)
    unknown = [r for r in runners if r not in RUNNERS]
    if unknown:
        p.error(f"unknown runners {unknown}; choose from {', '.join(RUNNERS)}")
    missing = [str(x) for x in args.results if not x.is_file()]
    if missing:
        p.error(f"no such results file: {', '.join(missing)}")
    print(report(args.results, runners))
    return 0


if __name__ == "__main__":
    sys.exit(main())
