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


def interleaved(calls: dict[str, Callable[[], Any]], *, repeats: int, rounds: int = 5,
                warmup: int = 2) -> dict[str, float]:
  """Median seconds per call of each of `calls`, timed in alternating rounds.

  On a shared machine the background load drifts; alternating A, B, C, A, B, C... and
  taking the median of per-round medians exposes every variant to the same drift.
  """
  per_round: dict[str, list[float]] = {name: [] for name in calls}
  for _ in range(rounds):
    for name, fn in calls.items():
      per_round[name].append(time_call(fn, repeats=repeats, warmup=warmup)["median_s"])
  return {name: statistics.median(values) for name, values in per_round.items()}
