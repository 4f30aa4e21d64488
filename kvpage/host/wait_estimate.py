"""One wait estimator: how long until a request could get in, in seconds.

Every "when" the server answers comes from here: the `retry_after` of a 503 or a 429
and a waiting request's ETA (`Scheduler.eta`; a deadline check, when there is one,
compares against it, so that it and the hints agree). All three are read off one
forecast (`kvpage.host.forecast`): the scheduler's own rules run ahead over what it
holds now, each step priced by the step-cost model fit to the steps it ran
(`kvpage.host.step_cost`).

  * **503**: when the admission check that refused the request is forecast to pass:
    the free pages, less the admitted backlog's estimates and the pages of every
    rejected request told to come back before it, leave this request's estimate above
    the watermark.
  * **429**: when enough of the waiting queue (and the clients told to come back to it
    before) has been scheduled to leave a place.
  * **ETA**: when the forecast first schedules the waiting (or swapped) request, and
    when it samples its first token (what a waiting stream is told, `eta_s`).
  * **429/503 of a line on admitted requests** (a concurrency limit, an in-flight-token
    budget): when the forecast has ended enough of them to make room.
  * **A newcomer's first step and first token** (the forecast-TTFT lines and a
    request's own `max_queue_wait_s`, checked before it joins): the forecast with it
    queued last. One such forecast serves every newcomer of the same shape until the
    queues change, so a storm of refused requests runs one forecast, not one each.

Rejected requests stand in line. A 503 enters the request in a ledger under its id,
ranked by its first rejection, due at its hint and kept until it comes back (admitted,
or refused again: it keeps its rank with a new hint) or `retry_grace_s` after its
hint. The forecast admits the ledger's entries in rank order once due, so a later
client's hint stands behind every earlier promise: without that, a burst of
rejections all hear the same short hint and return together to room for one.

With `retry_reservations` on, admission keeps the promises too: each request is
checked against the line after the ledger's entries ranked ahead of it (all of them,
for a newcomer), so room that opens before a promised client returns is not taken by
whoever arrives first. The price is room idle until its holder returns, as long as
the hint is late. Off (the default), the ledger shapes hints only.

Requests rejected since the last forecast join its end without a new run: each holds
its estimate from now until its forecast end. A hint is never shorter than one step
(nothing changes sooner), stretched by a seeded factor in [1, 1 + retry_jitter) when
jitter is on, and capped at `max_retry_after_s`; without a single priced step yet it
is `default_retry_after_s`. Raw seconds: rounding to whole seconds is the gateway's.

Pure Python: never imports jax.
"""

import dataclasses
import heapq
import random
from collections.abc import Mapping

import ml_collections

from kvpage.host import forecast
from kvpage.host.pages import PagePool
from kvpage.host.step_cost import StepCostModel
from kvpage.request import Request
from kvpage.units import cdiv

NEWCOMER = "\x00newcomer"  # the forecast's name for a request asking to join the queue


@dataclasses.dataclass
class Reservation:
  """A rejected request told when to come back: its place in line."""

  rank: int  # order of its first rejection: who is ahead of whom
  pages: int  # its page estimate
  due: float  # when it was told to come back
  expires: float  # when it leaves the line if it has not come back
  num_prompt_tokens: int  # what it will run, once admitted
  max_tokens: int


class WaitEstimator:
  """The step-cost model, the line of rejected requests, and the estimates."""

  def __init__(self, config: ml_collections.ConfigDict, page_pool: PagePool,
               watermark_pages: float, backlog: Mapping[str, int]):
    self.page_pool = page_pool
    self.backlog = backlog  # page estimates of admitted requests holding no device pages
    self.rules = dict(max_num_batched_tokens=config.max_num_batched_tokens,
                      chunk_size=config.chunk_size, max_num_seqs=config.max_num_seqs,
                      chunked=config.prefill_policy == "chunked",
                      page_size=page_pool.page_size, watermark_pages=watermark_pages,
                      horizon_s=config.max_retry_after_s)
    self.watermark_pages = watermark_pages
    self.chunk_tokens = config.chunk_size or config.max_num_batched_tokens
    self.default_s = config.default_retry_after_s
    self.max_s = config.max_retry_after_s
    self.jitter = config.retry_jitter
    self._rng = random.Random(config.retry_jitter_seed)
    self.reserve = bool(config.retry_reservations)
    self.grace_s = config.retry_grace_s
    self.costs = StepCostModel(config.step_cost_window)
    self.reservations: dict[str, Reservation] = {}  # the line, by request id
    self._num_ranked = 0
    self._slot_promises: list[float] = []  # when each 429'd client comes back
    # The last forecast: its key, the time it was made, its timeline, and what was
    # rejected since ((until when, pages), in seconds from the time it was made).
    self._forecast: tuple[object, float, forecast.Timeline | None,
                          list[tuple[float, int]]] = (None, 0.0, None, [])
    # Forecasts with a newcomer at the queue's tail, for one key: by the newcomer's shape.
    self._newcomers: tuple[object, dict[tuple, tuple[float, forecast.Timeline | None]]] = (
        None, {})

  # Observations.
  def observe_step(self, num_tokens: int, num_context_tokens: int, num_sequences: int,
                   seconds: float) -> None:
    """A step the executor ran: its tokens, the context it attended to, its time."""
    self.costs.observe(num_tokens, num_context_tokens, seconds, num_sequences=num_sequences)

  def priced(self) -> bool:
    """Whether the forecast can run: both kinds of step have been priced."""
    return (self.costs.coefficients(False) is not None
            and self.costs.coefficients(True) is not None)

  # The line.
  def reserved_ahead(self, request_id: str, now: float) -> int:
    """Pages held for requests ranked ahead of `request_id` (all, if it holds none);
    0 with reservations off. Lapsed entries leave the line first."""
    self._lapse(now)
    if not self.reserve or not self.reservations:
      return 0
    own = self.reservations.get(request_id)
    rank = own.rank if own is not None else self._num_ranked
    return sum(held.pages for held in self.reservations.values() if held.rank < rank)

  def num_held(self, now: float) -> int:
    """Places held in line for refused requests, not yet lapsed (0 with reservations
    off: the line then shapes hints only)."""
    if not self.reserve:
      return 0
    return sum(held.expires >= now for held in list(self.reservations.values()))

  def release(self, request_id: str) -> None:
    """Its holder is admitted: the room is now its backlog."""
    self.reservations.pop(request_id, None)

  # Estimates.
  def retry_after_pages(self, request: Request, num_pages: int, now: float,
                        queues: forecast.Queues) -> float:
    """The 503 hint for `request` (an estimate of `num_pages` pages); enters it in the
    line, or renews its place there."""
    rid = request.request_id
    timeline, made, taken = self._timeline(queues, now)
    held = self.reservations.get(rid)
    seconds: float | None
    if timeline is None:
      seconds = None
    elif held is not None and rid in timeline.admitted:
      seconds = max(0.0, timeline.admitted[rid] - (now - made))
    else:
      # Behind everything forecast and everyone rejected since. The forecast's clock
      # started when it was made; arrivals may come later within the same state.
      opens = timeline.first_room(self.watermark_pages + num_pages, taken)
      seconds = self.max_s if opens is None else max(0.0, opens - (now - made))
      if held is None:
        steps = cdiv(request.num_prompt_tokens, self.chunk_tokens)
        run_s = (steps + request.sampling.max_tokens) * timeline.seconds_per_step
        taken.append((now - made + seconds + run_s, num_pages))
    hint = self._hint(seconds, timeline)
    rank = held.rank if held is not None else self._next_rank()
    self.reservations[rid] = Reservation(rank, num_pages, now + hint, now + hint + self.grace_s,
                                         request.num_prompt_tokens, request.sampling.max_tokens)
    return hint

  def retry_after_slots(self, request: Request, slots_short: int, now: float,
                        queues: forecast.Queues) -> float:
    """The 429 hint: `slots_short` waiting-queue places missing, behind the clients told
    to come back before; a page reservation `request` holds is kept until then."""
    while self._slot_promises and self._slot_promises[0] <= now:
      heapq.heappop(self._slot_promises)
    timeline, made, _ = self._timeline(queues, now)
    seconds = None
    if timeline is not None:
      departures = [when - (now - made) for when in timeline.departures
                    if when >= now - made]
      index = max(slots_short, 1) + len(self._slot_promises) - 1
      if index < len(departures):
        seconds = departures[index]
      elif len(departures) >= 2:  # past the forecast's departures: at their pace
        pace = (departures[-1] - departures[0]) / (len(departures) - 1)
        seconds = departures[-1] + (index - len(departures) + 1) * pace
    hint = self._hint(seconds, timeline)
    heapq.heappush(self._slot_promises, now + hint)
    held = self.reservations.get(request.request_id)
    if held is not None:
      held.due, held.expires = now + hint, now + hint + self.grace_s
    return hint

  def retry_after_ends(self, needed: float, now: float, queues: forecast.Queues,
                       weight: Mapping[str, float] | None = None) -> float:
    """The hint of a line on what admitted requests hold (the concurrency limit, the
    in-flight-token budget): when the forecast has ended enough of them that `needed`
    is freed, each end freeing its `weight` (by request id; 1 each by default)."""
    timeline, made, _ = self._timeline(queues, now)
    seconds = None
    if timeline is not None:
      seconds, freed = self.max_s, 0.0
      for when, rid in timeline.ends:
        freed += 1.0 if weight is None else weight.get(rid, 0.0)
        if freed >= needed:
          seconds = max(0.0, when - (now - made))
          break
    return self._hint(seconds, timeline)

  def retry_after_deadline(self, request: Request, estimate: int, seconds_over: float,
                           now: float, queues: forecast.Queues) -> float:
    """The hint for a newcomer (see `newcomer_eta`) whose forecast wait exceeds its
    deadline by `seconds_over`: the queue ahead of it drains a second per second, so
    then the wait would fit."""
    timeline, _ = self._newcomer_timeline(request, estimate, queues, now)
    return self._hint(seconds_over, timeline)

  def eta(self, request: Request, now: float, queues: forecast.Queues, *,
          first_token: bool = False) -> float:
    """Seconds until an admitted request holding no device pages is forecast to be
    scheduled, or with `first_token` to sample its first token (the end of the step
    computing the last of its prompt). Before any step was priced: at the head of the
    queue 0 (its idle time to first token), else `default_retry_after_s`."""
    timeline, made, _ = self._timeline(queues, now)
    if timeline is None:
      at_head = not queues.swapped and bool(queues.waiting) and queues.waiting[0] is request
      if not at_head:
        return self.default_s
      return self.idle_first_token_s(request) if first_token else 0.0
    when = (timeline.first_tokens if first_token else timeline.scheduled).get(
        request.request_id)
    return self.max_s if when is None else max(0.0, when - (now - made))

  def newcomer_eta(self, request: Request, estimate: int, now: float,
                   queues: forecast.Queues) -> tuple[float, float]:
    """Seconds until `request` (not yet queued; `estimate` its page estimate), were it to
    join the tail of the waiting queue now, is forecast to be first scheduled and to
    sample its first token (the end of the step computing the last of its prompt).
    Before any step was priced: (0, its idle time to first token) on an empty queue,
    else `default_retry_after_s` twice.

    Nothing ahead of a newcomer depends on it (the queue is served in order), so one
    forecast serves every newcomer of the same shape while the queues stand still: a
    refused request leaves them as they were, and the next arrival reuses the forecast
    instead of running its own."""
    timeline, made = self._newcomer_timeline(request, estimate, queues, now)
    if timeline is None:
      if not queues.swapped and not queues.waiting:
        return 0.0, self.idle_first_token_s(request)
      return self.default_s, self.default_s
    when = [timeline.scheduled.get(NEWCOMER), timeline.first_tokens.get(NEWCOMER)]
    first_step, first_token = (self.max_s if w is None else max(0.0, w - (now - made))
                               for w in when)
    return first_step, first_token

  def idle_first_token_s(self, request: Request) -> float:
    """Seconds from arrival to first token of `request` alone on an idle engine: its
    prompt's chunks, one priced prefill step each; 0 before prefill steps are priced."""
    costs = self.costs.coefficients(True)
    if costs is None:
      return 0.0
    chunk = min(self.chunk_tokens, self.rules["max_num_batched_tokens"])
    seconds, done = 0.0, request.num_computed_tokens
    while done < request.num_prompt_tokens:
      tokens = min(chunk, request.num_prompt_tokens - done)
      done += tokens
      seconds += forecast.step_seconds(costs, tokens, done)
    return seconds

  # Internals.
  def _timeline(self, queues: forecast.Queues,
                now: float) -> tuple[forecast.Timeline | None, float, list[tuple[float, int]]]:
    """The forecast for `queues` (run once per key), when it was made, and the
    requests rejected since."""
    key, made, timeline, taken = self._forecast
    if key == queues.key and timeline is not None:
      return timeline, made, taken
    self._lapse(now)
    self._forecast = (queues.key, now, self._run(queues, now), [])
    return self._forecast[2], now, self._forecast[3]

  def _newcomer_timeline(self, request: Request, estimate: int, queues: forecast.Queues,
                         now: float) -> tuple[forecast.Timeline | None, float]:
    """The forecast for `queues` with `request` queued last (as `NEWCOMER`) up to its
    first token, when it was made: run once per key and newcomer shape (see
    `newcomer_eta`)."""
    key, by_shape = self._newcomers
    if key != queues.key:
      by_shape = {}
      self._newcomers = (queues.key, by_shape)
    rid = request.request_id
    shape = (request.num_prompt_tokens, request.sampling.max_tokens, request.num_sampled,
             request.num_computed_tokens, estimate, rid if rid in self.reservations else None)
    if shape not in by_shape:
      self._lapse(now)
      newcomer = dataclasses.replace(forecast.job_of(request, estimate), request_id=NEWCOMER,
                                     waiting=True)
      by_shape[shape] = (now, self._run(queues, now, newcomer, rid))
    made, timeline = by_shape[shape]
    return timeline, made

  def _run(self, queues: forecast.Queues, now: float, newcomer: forecast.Job | None = None,
           newcomer_id: str = "") -> forecast.Timeline | None:
    """The forecast of `queues` from `now` (`newcomer`, if given, queued last, its
    reservation not counted twice); None before both kinds of step are priced."""
    decode_costs, prefill_costs = self.costs.coefficients(False), self.costs.coefficients(True)
    if decode_costs is None or prefill_costs is None:
      return None
    pool = self.page_pool
    running = [forecast.job_of(request) for request in queues.running]
    queue = [forecast.job_of(request, self.backlog.get(request.request_id, 0))
             for request in (*queues.swapped, *queues.waiting)]
    for job in queue[len(queues.swapped):]:
      job.waiting = True
    if newcomer is not None:
      queue.append(newcomer)
    live = {request.request_id for request in (*queues.running, *queues.swapped,
                                               *queues.waiting)} | {newcomer_id}
    reserved = [forecast.Job(rid, held.num_prompt_tokens, held.max_tokens, 0, 0, held.pages,
                             due=max(0.0, held.due - now))
                for rid, held in sorted(self.reservations.items(), key=lambda kv: kv[1].rank)
                if rid not in live]
    rules = forecast.Rules(decode_costs=decode_costs, prefill_costs=prefill_costs,
                           **self.rules)
    ends = now  # when the steps in flight are expected back, one after the other
    for start, tokens, context, num_sequences, iterations in queues.in_flight:
      costs = prefill_costs if tokens != num_sequences else decode_costs
      ends = max(ends, start) + iterations * forecast.step_seconds(costs, tokens, context)
    return forecast.run(rules, pool.num_free_pages, running, queue, reserved,
                        start_s=ends - now, until=None if newcomer is None else NEWCOMER)

  def _hint(self, seconds: float | None, timeline: forecast.Timeline | None) -> float:
    if seconds is None or timeline is None:
      hint = self.default_s
    else:  # One step late rather than one early: an early client is refused again.
      hint = seconds + timeline.seconds_per_step
    if self.jitter:
      hint *= 1.0 + self.jitter * self._rng.random()
    return min(self.max_s, hint)

  def _next_rank(self) -> int:
    self._num_ranked += 1
    return self._num_ranked - 1

  def _lapse(self, now: float) -> None:
    for rid in [rid for rid, held in self.reservations.items() if held.expires < now]:
      del self.reservations[rid]
