"""SM clock and board power sampled while a benchmark runs, so two timings can be compared at
the clocks they ran at (a GPU at its power limit lowers its clocks: a denser stream of kernels
can run each kernel slower than a sparser one).

One sampler runs for the whole benchmark and timestamps its samples; a timing asks for the mean
over its own time windows. Starting a sampler per timing would perturb the timing itself:
``nvidia-smi`` initialising NVML takes host time and driver locks, and a measured call issuing
hundreds of launches feels that.

NVML through ``pynvml`` where it is importable, else one ``nvidia-smi`` subprocess polling;
neither there (CPU, no driver): nothing is sampled and the means are ``None``.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from typing import Any

PERIOD_S = 0.05


class ClockSampler:
    """``start()`` once; ``mean_mhz(windows)`` for the (t0, t1) ``time.perf_counter`` windows of
    one timing; ``stop()`` at the end."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.samples: list[tuple[float, float, float]] = []  # (perf_counter, SM MHz, W)
        self.source = "none"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> ClockSampler:
        read = _nvml_reader(self.index)
        if read is not None:
            self.source = "nvml"
            self._thread = threading.Thread(target=self._poll, args=(read,), daemon=True)
        elif shutil.which("nvidia-smi"):
            self.source = "nvidia-smi"
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", str(self.index), "--query-gpu=clocks.sm,power.draw",
                 "--format=csv,noheader,nounits", f"-lms={int(PERIOD_S * 1e3)}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            self._thread = threading.Thread(target=self._read_smi, daemon=True)
        if self._thread is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _poll(self, read: Any) -> None:
        while not self._stop.wait(PERIOD_S):
            self.samples.append((time.perf_counter(), *read()))

    def _read_smi(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                mhz, watts = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), mhz, watts))

    def _within(self, windows: list[tuple[float, float]], field: int) -> float | None:
        got = [s[field] for s in self.samples if any(t0 <= s[0] <= t1 for t0, t1 in windows)]
        return statistics.fmean(got) if got else None

    def mean_mhz(self, windows: list[tuple[float, float]]) -> float | None:
        return self._within(windows, 1)

    def mean_watts(self, windows: list[tuple[float, float]]) -> float | None:
        return self._within(windows, 2)


def _nvml_reader(index: int) -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # not installed, or no driver: the nvidia-smi fallback
        return None

    def read() -> tuple[float, float]:
        mhz = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
        return float(mhz), pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3

    return read
