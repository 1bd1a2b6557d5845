"""SM clock and board power sampled while a benchmark runs, so two timings can be compared at
the clocks they ran at (a GPU at its power limit lowers its clocks: a faster, denser stream of
kernels can run each kernel slower than a sparser one).

NVML through ``pynvml`` where it is importable, else ``nvidia-smi`` polling in a subprocess;
neither there (CPU, no driver): nothing is sampled and the means are ``None``.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
from typing import Any

PERIOD_S = 0.01


class ClockSampler:
    """``with ClockSampler() as s: ...`` then ``s.mean_mhz`` and ``s.mean_watts`` over the block."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.samples: list[tuple[float, float]] = []  # (SM MHz, W)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> ClockSampler:
        self.samples = []
        self._stop.clear()
        read = _nvml_reader(self.index)
        if read is not None:
            self._thread = threading.Thread(target=self._poll, args=(read,), daemon=True)
        elif shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", str(self.index), "--query-gpu=clocks.sm,power.draw",
                 "--format=csv,noheader,nounits", f"-lms={int(PERIOD_S * 1e3)}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            self._thread = threading.Thread(target=self._read_smi, daemon=True)
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _poll(self, read: Any) -> None:
        while not self._stop.wait(PERIOD_S):
            self.samples.append(read())

    def _read_smi(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                mhz, watts = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((mhz, watts))

    @property
    def mean_mhz(self) -> float | None:
        return statistics.fmean(s[0] for s in self.samples) if self.samples else None

    @property
    def mean_watts(self) -> float | None:
        return statistics.fmean(s[1] for s in self.samples) if self.samples else None


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
