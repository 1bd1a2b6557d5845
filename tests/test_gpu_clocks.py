"""The benchmark's clock sampler attributes samples to the time windows of one timing."""

from __future__ import annotations

from benchmarks.gpu_clocks import ClockSampler


def test_means_cover_only_the_samples_inside_the_windows():
    s = ClockSampler()
    s.samples = [(1.0, 1980.0, 300.0), (2.0, 1600.0, 690.0), (3.0, 1500.0, 700.0),
                 (4.0, 1900.0, 400.0)]  # fmt: skip
    assert s.mean_mhz([(1.5, 3.5)]) == 1550.0
    assert s.mean_mhz([(0.5, 1.5), (3.5, 4.5)]) == 1940.0
    assert s.mean_watts([(1.5, 2.5)]) == 690.0
    assert s.mean_mhz([(5.0, 6.0)]) is None  # a window no sample fell in
