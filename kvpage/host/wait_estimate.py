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
room for one. The ledger shapes hints only; admission never holds room for anyone.

With `retry_jitter` > 0 a hint is stretched by a seeded uniform factor in
[1, 1 + retry_jitter), so clients told the same moment spread out. Estimates are raw
seconds, capped at `max_retry_after_s`; rounding to whole seconds is the gateway's.

Pure Python: never imports jax.
"""

import collections
import heapq
import random
from collections.abc import Sequence

import ml_collections

from kvpage.host.pages import PagePool
from kvpage.host.request import Request


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
      pool, chunk = self.page_pool, self.chunk_size
      for request in running:
        prefill = max(0, request.num_prompt_tokens - request.num_computed_tokens)
        steps = -(-prefill // chunk) + request.sampling.max_tokens - request.num_sampled
        events.append((steps * step_s, pool.pages_for(request.num_prompt_tokens
                                                      + request.sampling.max_tokens)))
      events.sort()
    self._forecast = (key, events)
    return events

  def seconds_for_pages(self, num_pages: float, now: float,
                        forecast: Sequence[tuple[float, int]] = (),
                        promised: Sequence[tuple[float, int]] = ()) -> float | None:
    """Seconds until `num_pages` more pages have drained (plus the `promised` pages due
    before then: (seconds from now, pages), soonest first); None if nothing drains."""
    need, freed, rate = max(num_pages, 0.0), 0, self.free_rate(now)
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
                        running: Sequence[Request] = (), key: object = None) -> float:
    """The 503 hint: `pages_short` below the line for a request of `num_pages` pages,
    behind the promises due before it; records the promise."""
    self._expire(now)
    promised = sorted((when - now, pages) for when, pages, _ in self._promises if pages)
    seconds = self.seconds_for_pages(max(pages_short, 1.0), now,
                                     self.drain_forecast(running, key, now), promised)
    return self._promise(seconds, now, num_pages, 0)

  def retry_after_slots(self, slots_short: int, now: float) -> float:
    """The 429 hint: `slots_short` queue places missing, behind those promised earlier;
    records the promise."""
    self._expire(now)
    seconds = self.seconds_for_slots(max(slots_short, 1) + self.promised_slots, now)
    return self._promise(seconds, now, 0, 1)

  def _promise(self, seconds: float | None, now: float, pages: int, slots: int) -> float:
    hint = self.default_s if seconds is None else seconds
    if self.jitter:
      hint *= 1.0 + self.jitter * self._rng.random()
    hint = min(self.max_s, hint)
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
