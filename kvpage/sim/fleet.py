"""A fleet on one timeline: simulated replicas behind one door, run as discrete events.

Each replica is an engine with a virtual clock of its own (its device's timeline;
`kvpage.build.sim_engine` gives each one). The run always does the earliest thing
next: the next arrival, or a step of the replica whose clock is furthest behind among
those with work. An arrival at time t is routed once no busy replica's clock is behind
t (idle replicas jump to t), so every replica it meets has reached the moment it
arrives, within the step in flight, as a real fleet's would. The door is
`kvpage.host.routing.route`: the router ranks the replicas from a snapshot
(`replica_stats`) refreshed every `refresh_s` of simulated time and counts what it
sent in between; the replicas are asked in rank order until one admits.

Host side only, like the rest of the simulator: never imports jax.
"""

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Mapping, Sequence

from kvpage.clock import VirtualClock
from kvpage.host.engine import MAX_IDLE_STEPS, Engine
from kvpage.host.routing import Routed, Router, RouteRequest, prompt_hashes, replica_stats, route
from kvpage.request import Request, SamplingParams
from kvpage.sim.workload import TraceRequest


@dataclasses.dataclass
class FleetRequest:
  """One arrival at the fleet's door: where it went (None: every replica refused) and
  the request there (its events hold its latencies)."""

  item: TraceRequest
  routed: Routed
  request: Request | None


def replay_fleet(engines: Mapping[str, Engine], router: Router,
                 trace: Sequence[TraceRequest], *,
                 make_sampling: Callable[[TraceRequest], SamplingParams],
                 refresh_s: float = 0.1) -> list[FleetRequest]:
  """Runs `trace` through the fleet `engines` (each on a `VirtualClock` of its own) to
  the end; returns every arrival's outcome, in arrival order."""
  clocks = {name: engine.clock for name, engine in engines.items()}
  if not all(isinstance(clock, VirtualClock) for clock in clocks.values()):
    raise ValueError("a simulated fleet needs each replica on a virtual clock of its own")
  if len({id(clock) for clock in clocks.values()}) != len(clocks):
    raise ValueError("two replicas share a clock: each needs its own timeline")
  page_size = next(iter(engines.values())).scheduler.page_pool.page_size
  order = itertools.count()
  pending = [(item.arrival_time, next(order), item)
             for item in sorted(trace, key=lambda r: r.arrival_time)]
  start = pending[0][0] if pending else 0.0  # the trace's first arrival is t = 0
  for clock in clocks.values():
    clock.advance_to(0.0)
  out: list[FleetRequest] = []
  next_refresh = 0.0
  while True:
    busy = [name for name, engine in engines.items() if engine.has_unfinished()]
    behind = min(busy, key=lambda name: clocks[name]()) if busy else None
    if pending and (behind is None or pending[0][0] - start <= clocks[behind]()):
      when, _, item = heapq.heappop(pending)
      now = when - start
      for name in engines:
        if not engines[name].has_unfinished():
          clocks[name].advance_to(now)  # an idle replica's time passes to the arrival
      if now >= next_refresh:
        router.update([replica_stats(name, engine.scheduler)
                       for name, engine in engines.items()])
        next_refresh = now + refresh_s
      out.append(_arrive(engines, router, item, now, make_sampling(item), page_size))
    elif behind is not None:
      engine = engines[behind]
      engine.step()
      if engine.idle_steps > MAX_IDLE_STEPS:
        raise RuntimeError(f"replica {behind}: no progress in {MAX_IDLE_STEPS} steps: "
                           f"{engine.scheduler.stats()}")
    else:
      return out


def _arrive(engines: Mapping[str, Engine], router: Router, item: TraceRequest, now: float,
            sampling: SamplingParams, page_size: int) -> FleetRequest:
  """One arrival through the door: a request made for each replica asked, admitted by
  at most one (the others end refused: their pages were never held)."""
  made: dict[str, Request] = {}

  def admit(name: str):
    request, answer = engines[name].add_request(
        item.prompt_ids, sampling, request_id=f"{item.request_id}@{name}",
        priority=item.priority, arrival_time=now)
    made[name] = request
    return answer

  wanted = RouteRequest(len(item.prompt_ids), sampling.max_tokens,
                        prompt_hashes(item.prompt_ids, page_size))
  routed = route(router, wanted, admit)
  return FleetRequest(item, routed, made.get(routed.replica_id) if routed.replica_id else None)
