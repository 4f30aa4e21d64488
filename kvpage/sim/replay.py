"""Drive an engine with a workload: arrivals on the clock, steps in between.

Requests are submitted when the clock passes their arrival time; while anything is
admitted the engine steps, and when it is idle the loop waits for the next arrival
(sleeping on a wall clock, jumping ahead on a virtual one). Arrivals that fall
inside a step are submitted right after it, stamped with their true arrival time, so
queueing delay is measured, not hidden. Identical for real and simulated runs.
"""

import collections
import time
from collections.abc import Callable, Sequence

from kvpage.host.engine import MAX_IDLE_STEPS, Engine
from kvpage.host.request import Request, SamplingParams
from kvpage.sim.clock import VirtualClock
from kvpage.sim.workload import TraceRequest


def replay(engine: Engine, trace: Sequence[TraceRequest], *,
           make_sampling: Callable[[TraceRequest], SamplingParams],
           on_submit: Callable[[Request], None] | None = None,
           on_step: Callable[[], None] | None = None) -> list[Request]:
  """Runs `trace` through `engine` to the end; returns every submitted request."""
  clock = engine.clock
  pending = collections.deque(sorted(trace, key=lambda r: r.arrival_time))
  # A recorded trace may start at any time: its first arrival is this replay's t = 0.
  start = clock() - (pending[0].arrival_time if pending else 0.0)
  submitted = []
  while pending or engine.has_unfinished():
    now = clock() - start
    while pending and pending[0].arrival_time <= now:
      item = pending.popleft()
      request, _ = engine.add_request(item.prompt_ids, make_sampling(item),
                                      request_id=item.request_id, priority=item.priority,
                                      arrival_time=start + item.arrival_time)
      submitted.append(request)
      if on_submit is not None:
        on_submit(request)
    if engine.has_unfinished():
      engine.step()
      if engine.idle_steps > MAX_IDLE_STEPS:
        raise RuntimeError(f"no progress in {MAX_IDLE_STEPS} steps: {engine.scheduler.stats()}")
      if on_step is not None:
        on_step()
    elif pending:
      _wait_until(clock, start + pending[0].arrival_time)
  return submitted


def _wait_until(clock: Callable[[], float], when: float) -> None:
  if isinstance(clock, VirtualClock):
    clock.advance_to(when)  # virtual time jumps
  else:
    time.sleep(max(0.0, when - clock()))
