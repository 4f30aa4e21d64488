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
from typing import Any

import numpy as np

from kvpage.clock import VirtualClock
from kvpage.host.engine import MAX_IDLE_STEPS, Engine
from kvpage.host.routing import (
    AFTER_KV_LINE,
    Routed,
    Router,
    RouteRequest,
    prompt_hashes,
    replica_stats,
    route,
)
from kvpage.metrics import MetricsRecorder, request_summary
from kvpage.request import Request, SamplingParams
from kvpage.sim.workload import TraceRequest

REFRESH_S = 0.1  # how often, in simulated seconds, the router's snapshots are refreshed
IMBALANCE_SAMPLES = 200  # points in time at which `summarize` compares the pools


@dataclasses.dataclass
class FleetRequest:
  """One arrival at the fleet's door: where it went (None: every replica refused), the
  request there (its events hold its latencies), and the request made at each replica
  asked (the refused ones end rejected)."""

  item: TraceRequest
  routed: Routed
  request: Request | None
  asked: dict[str, Request] = dataclasses.field(default_factory=dict)


def replay_fleet(engines: Mapping[str, Engine], router: Router,
                 trace: Sequence[TraceRequest], *,
                 make_sampling: Callable[[TraceRequest], SamplingParams],
                 refresh_s: float = REFRESH_S) -> list[FleetRequest]:
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
  return FleetRequest(item, routed, made.get(routed.replica_id) if routed.replica_id else None,
                      made)


def summarize(arrivals: Sequence[FleetRequest], recorders: Mapping[str, MetricsRecorder],
              premises: dict[str, Any], slo_ttft_s: float | None = None,
              slo_tpot_s: float | None = None
              ) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
  """A fleet run's summary, its request rows and its step rows, from each replica's
  `MetricsRecorder` (history on, every clock starting at 0 with the trace).

  A request's row is its replica's row of it (`MetricsRecorder.request_row`, with the
  trace's id and a `replica` field); a request every replica refused gets the row of the
  last replica asked, with the fleet's answer. Beside the figures one engine's summary
  has (`kvpage.metrics.request_summary`):
    * the door: requests every replica refused, by the fleet's status; its retries
      (replicas asked after a refusal, for the served); `refused_while_room`, arrivals
      a replica refused while another had room for them at that very moment (the door
      asks every replica at one instant of simulated time and a refusal changes
      nothing, so the replica that admitted had the room when the first refused: a
      door without retries would have pushed each back); `refused_with_kv_room`,
      arrivals every replica refused while some had KV room for them (it refused by a
      line checked after the KV line, `routing.AFTER_KV_LINE`);
    * the pools: each replica's peak KV use, the peak over the mean of the peaks, and
      over time (`_pools_over_time`)."""
  rows = []
  for arrival in arrivals:
    name = arrival.routed.replica_id or arrival.routed.tried[-1][0]
    request = arrival.request or arrival.asked[name]
    row = recorders[name].request_row(request) | {
        "request_id": arrival.item.request_id, "replica": arrival.routed.replica_id,
        "replicas_asked": len(arrival.routed.tried)}
    if arrival.request is None:
      row.update(rejected_status=arrival.routed.answer.status,
                 reject_reason=arrival.routed.answer.cause)
    rows.append(row)
  steps = [row | {"replica": name} for name, recorder in recorders.items()
           for row in recorder.steps]
  duration = max((recorder.clock() - recorder.start_time for recorder in recorders.values()),
                 default=0.0)
  peaks = {name: max((row["kv_usage"] for row in recorder.steps), default=0.0)
           for name, recorder in recorders.items()}
  refused = [row for row in rows if row["replica"] is None]
  rejections: dict[str, int] = {}
  for row in refused:
    key = str(row["rejected_status"])
    rejections[key] = rejections.get(key, 0) + 1
  stats = [recorder.scheduler.stats() for recorder in recorders.values()]
  queried = sum(s.get("prefix_query_tokens", 0) for s in stats)
  mean_peak = float(np.mean(list(peaks.values()))) if peaks else 0.0
  routes = [arrival.routed for arrival in arrivals]
  summary = dict(
      num_requests=len(rows), num_admitted=len(rows) - len(refused),
      rejections=rejections, num_rejected=len(refused),
      door_retries=sum(row["replicas_asked"] - 1 for row in rows if row["replica"]),
      refused_while_room=sum(len(r.tried) > 1 for r in routes if r.replica_id is not None),
      refused_with_kv_room=sum(any(answer.cause in AFTER_KV_LINE for _, answer in r.tried)
                               for r in routes if r.replica_id is None),
      num_preemptions=sum(s["num_preemptions"] for s in stats), duration_s=duration,
      replicas=len(recorders), max_kv_usage=max(peaks.values(), default=0.0),
      peak_kv_usage=peaks,
      pool_peak_imbalance=max(peaks.values()) / mean_peak if mean_peak else None,
      **_pools_over_time(recorders, duration),
      prefix_hit_rate=(sum(s.get("prefix_hit_tokens", 0) for s in stats) / queried
                       if queried else None),
      **request_summary(rows, duration, slo_ttft_s, slo_tpot_s), premises=premises)
  return summary, rows, steps


def _pools_over_time(recorders: Mapping[str, MetricsRecorder],
                     duration: float) -> dict[str, float | None]:
  """How the pools fill over the run, at `IMBALANCE_SAMPLES` instants spread evenly over
  it (each pool's KV use held from one of its steps to the next; 0 before its first):
  the fullest pool's use and the mean pool's, each averaged over the instants
  (`kv_usage_fullest`, `kv_usage_mean`), and their ratio (`pool_imbalance_over_time`:
  1 when every pool is as full as the others at every instant; N replicas with one
  doing all the work: N; None when no pool held a page). A ratio of averages, so the
  nearly idle moments at a run's ends, where one busy pool among idle ones reads as N,
  weigh as little as the pages they hold."""
  none = dict(pool_imbalance_over_time=None, kv_usage_fullest=None, kv_usage_mean=None)
  if duration <= 0 or not recorders:
    return none
  instants = np.linspace(0.0, duration, IMBALANCE_SAMPLES)
  usage = []
  for recorder in recorders.values():
    times = np.array([row["time"] for row in recorder.steps], np.float64)
    values = np.array([row["kv_usage"] for row in recorder.steps], np.float64)
    if not len(times):
      usage.append(np.zeros_like(instants))
      continue
    index = np.searchsorted(times, instants, side="right") - 1
    usage.append(np.where(index >= 0, values[np.maximum(index, 0)], 0.0))
  table = np.stack(usage)  # replicas x instants
  fullest, mean = float(table.max(axis=0).mean()), float(table.mean())
  if mean <= 0:
    return none
  return dict(pool_imbalance_over_time=fullest / mean, kv_usage_fullest=fullest,
              kv_usage_mean=mean)
