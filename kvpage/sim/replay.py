"""Drive an engine with a workload: arrivals on the clock, steps in between.

Requests are submitted when the clock passes their arrival time; while anything is
admitted the engine steps, and when it is idle the loop waits for the next arrival
(sleeping on a wall clock, jumping ahead on a virtual one). Arrivals that fall
inside a step are submitted right after it, stamped with their true arrival time, so
queueing delay is measured, not hidden. Identical for real and simulated runs.

A client that retries when told passes `on_reject`: given a rejected item, its
answer and the time of the answer (on the trace's clock), it returns the item to
submit again (its `arrival_time` is when), or None to give up.
"""

import heapq
import itertools
import time
from collections.abc import Callable, Sequence

from kvpage.clock import VirtualClock
from kvpage.host.engine import MAX_IDLE_STEPS, Engine
from kvpage.interface import Admission
from kvpage.request import Request, SamplingParams
from kvpage.sim.workload import TraceRequest


def replay(engine: Engine, trace: Sequence[TraceRequest], *,
           make_sampling: Callable[[TraceRequest], SamplingParams],
           on_submit: Callable[[Request], None] | None = None,
           on_step: Callable[[], None] | None = None,
           on_reject: Callable[[TraceRequest, Admission, float], TraceRequest | None]
           | None = None) -> list[Request]:
  """Runs `trace` through `engine` to the end; returns every submitted request."""
  clock = engine.clock
  order = itertools.count()  # ties keep the trace's order
  pending = [(item.arrival_time, next(order), item)
             for item in sorted(trace, key=lambda r: r.arrival_time)]
  # A recorded trace may start at any time: its first arrival is this replay's t = 0.
  start = clock() - (pending[0][0] if pending else 0.0)
  submitted = []
  while pending or engine.has_unfinished():
    now = clock() - start
    while pending and pending[0][0] <= now:
      item = heapq.heappop(pending)[2]
      request, answer = engine.add_request(item.prompt_ids, make_sampling(item),
                                           request_id=item.request_id, priority=item.priority,
                                           arrival_time=start + item.arrival_time)
      submitted.append(request)
      if on_submit is not None:
        on_submit(request)
      again = None if answer.admitted or on_reject is None else on_reject(item, answer, now)
      if again is not None:
        heapq.heappush(pending, (again.arrival_time, next(order), again))
    if engine.has_unfinished():
      engine.step()
      if engine.idle_steps > MAX_IDLE_STEPS:
        raise RuntimeError(f"no progress in {MAX_IDLE_STEPS} steps: {engine.scheduler.stats()}")
      if on_step is not None:
        on_step()
    elif pending:
      _wait_until(clock, start + pending[0][0])
  return submitted


def _wait_until(clock: Callable[[], float], when: float) -> None:
  if isinstance(clock, VirtualClock):
    clock.advance_to(when)  # virtual time jumps
  else:
    time.sleep(max(0.0, when - clock()))
