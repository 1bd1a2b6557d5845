"""Where a running server's host time goes: `capture-service` under a sampling profiler.

    python3 benchmarks/host_profile.py --out prof.json -- serve --executor local ...

runs the CLI in this process and, from a daemon thread, samples every thread's Python stack
every ``--interval`` seconds (``sys._current_frames``: no ptrace, so it works in containers
where py-spy cannot attach). When the server exits (SIGTERM drains it as usual) it writes, per
thread, the share of samples in each function (inclusive: the function is on the stack; self: it
is the innermost frame), and prints the top rows. A thread parked in a wait (a lock, a queue, a
selector, ``time.sleep``) counts as idle, so the busy shares say what competes for the GIL. The
sampler itself takes the GIL for a few microseconds per sample; keep the interval >= 1 ms.
With ``--on-signal`` it records only between a SIGUSR1 and a SIGUSR2 (the benchmark window,
not start-up and capture).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from types import FrameType

# Innermost frames that mean "this thread is waiting, not working".
IDLE = {
    ("threading.py", "wait"), ("threading.py", "_wait_for_tstate_lock"), ("queue.py", "get"),
    ("selectors.py", "select"), ("threading.py", "join"), ("thread.py", "_worker"),
    ("host_profile.py", "_sample"),
}  # fmt: skip


def frame_key(f: FrameType) -> str:
    code = f.f_code
    path = code.co_filename
    short = path.rsplit("/", 2)
    return f"{'/'.join(short[-2:])}:{code.co_name}"


class Sampler:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.samples: Counter[str] = Counter()  # thread -> samples
        self.idle: Counter[str] = Counter()
        self.inclusive: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.self_: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.recording = threading.Event()
        self.recorded_s = 0.0
        self._since = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="host-profile", daemon=True)

    def start(self, recording: bool = True) -> None:
        self._thread.start()
        if recording:
            self.resume()

    def resume(self) -> None:
        self._since = time.monotonic()
        self.recording.set()

    def pause(self) -> None:
        if self.recording.is_set():
            self.recording.clear()
            self.recorded_s += time.monotonic() - self._since

    def stop(self) -> None:
        self.pause()
        self._stop.set()
        self._thread.join(timeout=5)

    def _sample(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            if not self.recording.is_set():
                continue
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, f"thread-{ident}")
                self.samples[name] += 1
                leaf = frame.f_code
                if (leaf.co_filename.rsplit("/", 1)[-1], leaf.co_name) in IDLE:
                    self.idle[name] += 1
                    continue
                self.self_[name][frame_key(frame)] += 1
                seen: set[str] = set()
                f: FrameType | None = frame
                while f is not None:
                    key = frame_key(f)
                    if key not in seen:
                        seen.add(key)
                        self.inclusive[name][key] += 1
                    f = f.f_back

    def report(self, top: int) -> dict:
        threads = {}
        for name, n in self.samples.most_common():
            busy = n - self.idle[name]
            inclusive, self_ = self.inclusive[name], self.self_[name]
            threads[name] = {
                "samples": n,
                "busy_share": round(busy / n, 4),
                "inclusive": [(k, round(c / n, 4)) for k, c in inclusive.most_common(top)],
                "self": [(k, round(c / n, 4)) for k, c in self_.most_common(top)],
            }
        return {
            "interval_s": self.interval_s,
            "recorded_s": round(self.recorded_s, 2),
            "threads": threads,
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file for the profile")
    p.add_argument("--interval", type=float, default=0.002, help="seconds between samples")
    p.add_argument("--top", type=int, default=25, help="rows per thread and kind")
    p.add_argument("--min-samples", type=int, default=50, help="threads with fewer are not printed")
    p.add_argument("--on-signal", action="store_true",
                   help="record only from SIGUSR1 to SIGUSR2")  # fmt: skip
    p.add_argument("cli", nargs=argparse.REMAINDER, help="-- then capture-service's arguments")
    args = p.parse_args()
    argv = args.cli[1:] if args.cli[:1] == ["--"] else args.cli
    if not argv:
        p.error("give capture-service's arguments after --")

    from service.cli import main as cli_main

    sampler = Sampler(args.interval)
    if args.on_signal:
        signal.signal(signal.SIGUSR1, lambda *_: sampler.resume())
        signal.signal(signal.SIGUSR2, lambda *_: sampler.pause())
    sampler.start(recording=not args.on_signal)
    try:
        rc = cli_main(argv)
    finally:
        sampler.stop()
        report = sampler.report(args.top)
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"host profile: {report['recorded_s']} s recorded, every {args.interval} s")
        for name, t in report["threads"].items():
            if t["samples"] < args.min_samples:
                continue
            print(f"== thread {name}: {t['samples']} samples, busy {t['busy_share']:.1%}")
            for kind in ("self", "inclusive"):
                for key, share in t[kind][:12]:
                    print(f"   {kind:9} {share:7.1%}  {key}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
