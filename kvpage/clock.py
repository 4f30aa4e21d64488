"""Clocks: wall time for real runs, virtual time for simulation.

The scheduler stamps every event with `clock()`. A real run reads the monotonic wall
clock; a simulated run reads a `VirtualClock` that the simulated executor advances by
each step's modelled duration, so the same scheduling code produces 13B-scale latency
figures on a laptop. A `PacedClock` is the simulated device in real time: advancing it
sleeps, so a simulated GPU can serve live clients (`experiments/serve.py
--executor=sim`), and the host's CPU is free while the "device" works, as with a GPU.
"""

import time


class WallClock:
  """Seconds from `time.monotonic`."""

  def __call__(self) -> float:
    return time.monotonic()


class VirtualClock:
  """Seconds that pass only when `advance` (or `advance_to`) says so."""

  def __init__(self, start: float = 0.0):
    self.now = float(start)

  def __call__(self) -> float:
    return self.now

  def advance(self, seconds: float) -> None:
    if seconds < 0:
      raise ValueError(f"time cannot go backwards ({seconds} s)")
    self.now += seconds

  def advance_to(self, when: float) -> None:
    self.now = max(self.now, when)


class PacedClock(WallClock):
  """Wall time that a simulated executor advances by sleeping through each step."""

  def advance(self, seconds: float) -> None:
    if seconds < 0:
      raise ValueError(f"time cannot go backwards ({seconds} s)")
    time.sleep(seconds)

  def advance_to(self, when: float) -> None:
    time.sleep(max(0.0, when - self()))
