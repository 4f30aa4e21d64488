"""Timing helpers shared by the benchmarks: warm up, repeat, report the median."""

import statistics
import time
from collections.abc import Callable
from typing import Any


def time_call(fn: Callable[[], Any], *, repeats: int, warmup: int = 2) -> dict[str, float]:
  """Median/p90/min seconds of `fn()`; `fn` must block until its result is ready."""
  for _ in range(warmup):
    fn()
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    samples.append(time.perf_counter() - start)
  samples.sort()
  return dict(median_s=statistics.median(samples), p90_s=samples[int(0.9 * (len(samples) - 1))],
              min_s=samples[0], repeats=repeats)
