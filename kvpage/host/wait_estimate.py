"""One wait estimator: how long until a request could get in, in seconds.

Every "when" the server answers comes from here: the `retry_after` of a 503 or a 429,
a waiting request's ETA (`Scheduler.eta`), and any deadline check (there is none yet;
a deadline would be compared against `Scheduler.eta`, so that it and the hints agree).

The estimate is what must drain before the request could be admitted (or, once
admitted, scheduled), over the rate at which it drains:

  * **pages** (503, and a waiting request's ETA): the pages short of the admission
    line (this request's estimate above the watermark, plus the backlog already
    admitted ahead of it). They drain as running requests finish: each running
    request frees its pages when its remaining tokens are done, one per step at the
    recent step rate, so the estimate is the moment the requests closest to the end
    have freed enough. Past the last running request (or before any step was seen)
    pages drain at the recent page-free rate: pages that finished and aborted
    requests handed back in the last `retry_after_window_s` seconds;
  * **queue slots** (429): the requests that must leave the waiting queue before it
    has room, over the queue's recent departure rate (requests leaving it per second).

A rejected client told to come back at `t` will want its pages (or its slot) then,
so until `t` passes it stands in line: a later rejected client's estimate also
counts the pages promised to those told to come back before its own moment. Without
that, a burst of rejections all hear the same short hint and return together to
room for one. By default the ledger shapes hints only; admission never holds room.

With `retry_reservations` on, a 503 also holds room: the rejected request's pages are
reserved under its id, in the order of its first rejection, from the moment of the
answer until it comes back with that id (admitted: the reservation becomes backlog;
rejected again: it keeps its place, with a new hint) or lapses `retry_grace_s` after
its hint. Admission counts, for every request, the reservations ranked ahead of it
(all of them, for a newcomer), and the hint is when the forecast drain covers the
pages short of the line counted the same way, so a hint is the moment the very
check that refused the request is forecast to pass. Held from the answer, not from
the hint: room that opens before a promised client returns must not go to whoever
arrives first, or every promise is broken at overload. The price is room idle until
its holder returns, as long as the hint is late. The forecast then also nets out the
pages running requests grow into before the drain, which otherwise makes it early.

With `retry_jitter` > 0 a hint is stretched by a seeded uniform factor in
[1, 1 + retry_jitter), so clients told the same moment spread out. Estimates are raw
seconds, capped at `max_retry_after_s`; rounding to whole seconds is the gateway's.

Pure Python: never imports jax.
"""

import collections
import dataclasses
import heapq
import random
from collections.abc import Sequence

import ml_collections

from kvpage.host.pages import PagePool
from kvpage.host.request import Request


@dataclasses.dataclass
class Reservation:
  """Room held for a rejected request until it comes back (`retry_reservations`)."""

  rank: int  # order of its first rejection: who is ahead of whom
  pages: int  # its page estimate
  due: float  # when it was told to come back
  expires: float  # when the room is released if it has not


class WaitEstimator:
  """Recent page-free and queue-departure rates, the ledger of promises, the estimates."""

  def __init__(self, config: ml_collections.ConfigDict, page_pool: PagePool):
    self.page_pool = page_pool
    self.chunk_size = (config.max_num_batched_tokens if config.prefill_policy == "none"
                       else config.chunk_size or config.max_num_batched_tokens)
    self.window_s = config.retry_after_window_s
    self.default_s = config.default_retry_after_s
    self.max_s = config.max_retry_after_s
    self.jitter = config.retry_jitter
    self._rng = random.Random(config.retry_jitter_seed)
    self._frees: collections.deque[tuple[float, int]] = collections.deque()
    self._num_freed = 0  # pages in `_frees`
    self._departures: collections.deque[float] = collections.deque()
    self._steps: collections.deque[float] = collections.deque()
    self._forecast: tuple[object, list[tuple[float, int]]] = (None, [])
    # Promises: (time the client comes back, pages it will want, slots it will want).
    self._promises: list[tuple[float, int, int]] = []
    self.promised_pages = 0
    self.promised_slots = 0
    self.reserve = bool(config.retry_reservations)
    self.grace_s = config.retry_grace_s
    self.reservations: dict[str, Reservation] = {}  # by request id
    self._num_ranked = 0
    self._turnover = 0.0  # pages per second, from the last net forecast
    # Admitted requests that hold no device pages, with their estimates (by id):
    # kept by `AdmissionControl`, read by the net forecast.
    self.backlog: dict[str, tuple[Request, int]] = {}

  # Observations.
  def record_free(self, num_pages: int, now: float) -> None:
    """Pages that a finished or aborted request handed back."""
    if num_pages:
      self._frees.append((now, num_pages))
      self._num_freed += num_pages
      self._forget(now)

  def record_step(self, now: float) -> None:
    """A step was scheduled: the step rate that running requests progress at."""
    self._steps.append(now)
    self._forget(now)

  def record_departure(self, now: float) -> None:
    """A request left the waiting queue (scheduled, or ended while waiting)."""
    self._departures.append(now)
    self._forget(now)

  # Rates.
  def free_rate(self, now: float) -> float:
    """Pages freed per second over the window (0 if none)."""
    self._forget(now)
    # Over the whole window, not since the first free in it: one burst of frees must
    # not promise a rate the server cannot sustain.
    return self._num_freed / self.window_s

  def departure_rate(self, now: float) -> float:
    """Requests that left the waiting queue per second over the window (0 if none)."""
    self._forget(now)
    return len(self._departures) / self.window_s

  # Estimates.
  def seconds_per_step(self, now: float) -> float | None:
    """Mean seconds between recent steps; None before two steps in the window."""
    self._forget(now)
    steps = self._steps
    return (steps[-1] - steps[0]) / (len(steps) - 1) if len(steps) > 1 else None

  def drain_forecast(self, running: Sequence[Request], key: object,
                     now: float) -> list[tuple[float, int]]:
    """(seconds from now, pages freed) as each running request finishes, soonest first.

    A request frees the pages of its prompt and all its `max_tokens` (fewer if a stop
    token ends it early: the forecast is then late, never early). Cached per `key`
    (the scheduler's step and finish counts): rejections in one step share it.
    """
    if self._forecast[0] == key:
      return self._forecast[1]
    step_s = self.seconds_per_step(now)
    events: list[tuple[float, int]] = []
    if step_s is not None:
      if self.reserve:
        events = self._net_forecast(running, step_s)
      else:
        pool, chunk = self.page_pool, self.chunk_size
        for request in running:
          prefill = max(0, request.num_prompt_tokens - request.num_computed_tokens)
          steps = -(-prefill // chunk) + request.sampling.max_tokens - request.num_sampled
          events.append((steps * step_s, pool.pages_for(request.num_prompt_tokens
                                                        + request.sampling.max_tokens)))
        events.sort()
    self._forecast = (key, events)
    return events

  def _net_forecast(self, running: Sequence[Request],
                    step_s: float) -> list[tuple[float, int]]:
    """(seconds from now, net change in free pages) at each running request's end.

    A finished request returns the pages it holds now (what it grows into on the way
    is returned too, so it nets out), while those still running have taken the pages
    they grew into by then: counting each end at its full size, as the plain
    forecast does, is early by all that growth."""
    pool, chunk = self.page_pool, self.chunk_size
    rows = []  # (steps to its end, pages charged now, computed, prompt, total)
    # The admitted backlog joins too: scheduled (soon, as admission left room for it),
    # it trades its estimate at the line for the pages of its first chunk, and grows.
    charged = [(request, len(request.page_ids)) for request in running]
    charged.extend(self.backlog.values())
    for request, charge in charged:
      prompt, total = request.num_prompt_tokens, request.num_prompt_tokens + (
          request.sampling.max_tokens)
      computed = request.num_computed_tokens
      prefill = max(0, prompt - computed)
      steps = -(-prefill // chunk) + request.sampling.max_tokens - request.num_sampled
      rows.append((steps, charge, computed, prompt, total))
    rows.sort()
    # Past these ends, the cache turns over at its steady rate (Little's law): each
    # running request's peak pages over its whole time in the batch. Unlike the
    # recent free rate, it needs no history (a fresh window after a burst of arrivals
    # would say almost nothing drains) and no luck in which requests ended lately.
    self._turnover = sum(pool.pages_for(total) / ((-(-prompt // chunk) + total - prompt)
                                                  * step_s)
                         for _, _, _, prompt, total in rows)
    events: list[tuple[float, int]] = []
    returned, previous = 0, 0
    # One step ahead first: the backlog's first chunks may open room before any end.
    for index, (steps, held, *_) in [(-1, (1, 0)), *enumerate(rows)]:
      returned += held
      grown = 0
      for _, held_j, computed, prompt, total in rows[index + 1:]:
        prefill = max(0, prompt - computed)
        prefill_steps = -(-prefill // chunk)
        tokens = (min(prompt, computed + steps * chunk) if steps <= prefill_steps
                  else prompt + steps - prefill_steps)
        grown += max(0, pool.pages_for(min(total, tokens)) - held_j)
      net = returned - grown
      events.append((steps * step_s, net - previous))
      previous = net
    return events

  def seconds_for_pages(self, num_pages: float, now: float,
                        forecast: Sequence[tuple[float, int]] = (),
                        promised: Sequence[tuple[float, int]] = ()) -> float | None:
    """Seconds until `num_pages` more pages have drained (plus the `promised` pages due
    before then: (seconds from now, pages), soonest first); None if nothing drains."""
    need, freed = max(num_pages, 0.0), 0
    rate = (self._turnover if self.reserve and forecast else 0.0) or self.free_rate(now)
    if need <= 0:
      return 0.0
    due = iter(promised)
    next_due = next(due, None)
    last = 0.0
    for seconds, pages in forecast:
      while next_due is not None and next_due[0] <= seconds:
        need += next_due[1]
        next_due = next(due, None)
      freed, last = freed + pages, seconds
      if freed >= need:
        return seconds
    # Past the forecast: the recent rate, or the forecast's own.
    rate = rate or (freed / last if last else 0.0)
    if not rate:
      return None
    need += sum(pages for _, pages in ([next_due] if next_due else [])) + sum(
        pages for _, pages in due)
    return last + (need - freed) / rate

  def seconds_for_slots(self, num_slots: float, now: float) -> float | None:
    """Seconds until `num_slots` requests leave the waiting queue; None if unknown."""
    rate = self.departure_rate(now)
    return max(num_slots, 0.0) / rate if rate else None

  def retry_after_pages(self, pages_short: float, num_pages: int, now: float,
                        running: Sequence[Request] = (), key: object = None,
                        request_id: str = "") -> float:
    """The 503 hint: `pages_short` below the line for a request of `num_pages` pages,
    behind the promises due before it; records the promise. With reservations,
    `pages_short` already counts the reservations ahead (`reserved_ahead`), and the
    request's own is made or renewed under `request_id`."""
    if self.reserve:
      seconds = self.seconds_for_pages(max(pages_short, 1.0), now,
                                       self.drain_forecast(running, key, now))
      held = self.reservations.get(request_id)
      rank = held.rank if held is not None else self._next_rank()
      # Never before those ahead of it: their room comes first, whatever the rates
      # say now (a rate that rose since their hints would otherwise overtake them).
      ahead = max((other.due for other in self.reservations.values() if other.rank < rank),
                  default=now)
      hint = min(self.max_s, max(self._hint(seconds), ahead - now))
      self.reservations[request_id] = Reservation(rank, num_pages, now + hint,
                                                  now + hint + self.grace_s)
      return hint
    self._expire(now)
    promised = sorted((when - now, pages) for when, pages, _ in self._promises if pages)
    seconds = self.seconds_for_pages(max(pages_short, 1.0), now,
                                     self.drain_forecast(running, key, now), promised)
    return self._promise(seconds, now, num_pages, 0)

  def retry_after_slots(self, slots_short: int, now: float, request_id: str = "") -> float:
    """The 429 hint: `slots_short` queue places missing, behind those promised earlier;
    records the promise. A page reservation `request_id` holds is kept until then."""
    self._expire(now)
    seconds = self.seconds_for_slots(max(slots_short, 1) + self.promised_slots, now)
    hint = self._promise(seconds, now, 0, 1)
    held = self.reservations.get(request_id)
    if held is not None:
      held.due, held.expires = now + hint, now + hint + self.grace_s
    return hint

  # Reservations (`retry_reservations`).
  def reserved_ahead(self, request_id: str, now: float) -> int:
    """Pages reserved for requests ranked ahead of `request_id` (all, if it holds none);
    0 with reservations off. Lapsed reservations are released first."""
    if not self.reservations:
      return 0
    lapsed = [rid for rid, held in self.reservations.items() if held.expires < now]
    for rid in lapsed:
      del self.reservations[rid]
    own = self.reservations.get(request_id)
    rank = own.rank if own is not None else self._num_ranked
    return sum(held.pages for held in self.reservations.values() if held.rank < rank)

  def release(self, request_id: str) -> None:
    """Its holder is admitted: the room is now its backlog."""
    self.reservations.pop(request_id, None)

  def _next_rank(self) -> int:
    self._num_ranked += 1
    return self._num_ranked - 1

  def _hint(self, seconds: float | None) -> float:
    hint = self.default_s if seconds is None else seconds
    if self.jitter:
      hint *= 1.0 + self.jitter * self._rng.random()
    return min(self.max_s, hint)

  def _promise(self, seconds: float | None, now: float, pages: int, slots: int) -> float:
    hint = self._hint(seconds)
    heapq.heappush(self._promises, (now + hint, pages, slots))
    self.promised_pages += pages
    self.promised_slots += slots
    return hint

  def _expire(self, now: float) -> None:
    """Promises whose time came: the client is back (and admitted, or told again)."""
    while self._promises and self._promises[0][0] <= now:
      _, pages, slots = heapq.heappop(self._promises)
      self.promised_pages -= pages
      self.promised_slots -= slots

  def _forget(self, now: float) -> None:
    horizon = now - self.window_s
    while self._frees and self._frees[0][0] < horizon:
      self._num_freed -= self._frees.popleft()[1]
    while self._departures and self._departures[0] < horizon:
      self._departures.popleft()
    while self._steps and self._steps[0] < horizon:
      self._steps.popleft()
