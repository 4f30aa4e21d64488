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

With `retry_reservations` on, the ledger is a line of places that admission keeps,
whichever line refused (the cache, the waiting queue, a forecast-TTFT line, a
request's own deadline). Each request is checked against the places ahead of it, those
told to come back before it (all of them, for a newcomer): their pages below the KV
line and one waiting-queue place each. So room that opens before a promised client
returns is not taken by whoever arrives first. (A newcomer's forecast first token does
not wait for the places: their holders, back later, queue behind it. So a newcomer that
only the forecast-TTFT line or its own deadline refused is told when the queue it met
has drained, behind only the places those lines alone gave before it: not the line's
latest turn.)
A refusal's hint is its turn (`retry_after_line`): the forecast with it joining last,
each place ranked ahead joining at its own turn, at the latest of its pages fitting, a
queue place and its first token within the line; plus `LINE_MARGIN` of that and a
step, the jitter stretching only the step (stretched hints compound down the line).
Places are ahead of one another by when they are due, not by rank: a later refusal
told to come back sooner was forecast behind the earlier one's turn, so its room is
there at its due, and the earlier one's is there at its own.
A burst of refusals of one shape reads its turns off one forecast (`BURST` places).
The price is room idle until its holder returns, as long as the hint is late. Off
(the default), the ledger shapes hints only. A place whose turn lies past
`max_retry_after_s` is told the cap but stays due at its turn: back early, it is told
the rest.

Requests rejected since the last forecast join its end without a new run: each holds
its estimate from now until its forecast end. A hint is never shorter than one step
(nothing changes sooner), stretched by a seeded factor in [1, 1 + retry_jitter) when
jitter is on, and capped at `max_retry_after_s`; without a single priced step yet it
is `default_retry_after_s`. (With the line held, a refusal by the forecast-TTFT line
alone, or for a queue place alone, may be told less than a step: see
`retry_after_line`.) Raw seconds: rounding to whole seconds is the gateway's.

Pure Python: never imports jax.
"""

import bisect
import dataclasses
import heapq
import math
import random
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import ml_collections

from kvpage.host import forecast
from kvpage.host.pages import PagePool
from kvpage.host.step_cost import StepCostModel
from kvpage.request import Request
from kvpage.units import cdiv

NEWCOMER = "\x00newcomer"  # the forecast's name for a request asking to join the queue
# A place in line is told its turn plus this share of it, besides a step: the forecast
# knows no arrivals, stop tokens, preemptions or slower steps to come, and a client
# back too early is refused again, one back late only idles its room. Over HTTP at 10x
# (benchmarks/retry_http), a quarter left the median hint just under the wait needed
# and 72-79% of first retries admitted; a half, 81-88% with hints 1-1.25x the need.
LINE_MARGIN = 0.5
# A place only the forecast-TTFT line (or a deadline) gave stops counting in the turns
# of later such refusals this long after its hint, or its margin if longer, when its
# holder is not back: a client back on time arrives within milliseconds.
FIRST_TOKEN_PLACE_LATE_S = 0.05
# A turn that waits for a place in the waiting queue is told this share of a step at
# least as its margin (see `retry_after_line`).
QUEUE_STEP_SHARE = 0.25
BURST = 32  # places one forecast prices for a burst of new refusals of one shape
BURST_TTL_S = 0.1  # the longest new refusals read their turns off one forecast


@dataclasses.dataclass
class Reservation:
  """A rejected request told when to come back: its place in line."""

  rank: int  # order of its first rejection: who is ahead of whom
  pages: int  # its page estimate
  # When it was told to come back: where it stands in line. A holder refused on return
  # by a forecast-TTFT line or its deadline alone (its pages there) keeps the due it
  # had: due later, it fell behind every place due in between, and at 10x half of such
  # holders were then refused for pages on their next return.
  due: float
  expires: float  # when it leaves the line if it has not come back
  num_prompt_tokens: int  # what it will run, once admitted
  max_tokens: int
  # Pages running requests may grow into between its forecast turn and its hint: room
  # that was there at its turn, taken since only by growth, still counts as its own.
  slack_pages: int = 0
  turn: float = 0.0  # when its turn was forecast to come (its hint, less the margins)
  # Given by a forecast-TTFT line or a deadline alone to a newcomer (its pages fit past
  # the places ahead): a later refusal by those lines is told its turn behind it.
  first_token_line: bool = False


class Ahead(NamedTuple):
  """The places in line ahead of a request (`WaitEstimator.ahead`)."""

  places: int
  pages: int
  latest_turn: float  # the latest time one of them was forecast to get its turn


@dataclasses.dataclass
class _Burst:
  """One forecast with `BURST` places of one shape behind the line (`_burst_turn`)."""

  shape: tuple
  made: float  # when
  surprises: int  # the line's changes the forecast did not foresee, when it was made
  timeline: forecast.Timeline | None
  taken: int = 0  # places handed out


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
    self.max_waiting = config.max_waiting
    self._line_version = 0  # changes whenever the line does (a forecast cache key)
    self.grace_s = config.retry_grace_s
    self.costs = StepCostModel(config.step_cost_window)
    self.reservations: dict[str, Reservation] = {}  # the line, by request id
    self._num_ranked = 0
    self._prefix: tuple = (None, [], [0], [0.0])  # see `ahead`
    self._next_lapse = math.inf  # no place lapses before this
    self._burst: _Burst | None = None  # the last burst forecast (`_burst_turn`)
    self._surprises = 0  # places refused again or lapsed: what a burst did not foresee
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
    return self.ahead(request_id, now).pages

  def ahead(self, request_id: str, now: float) -> Ahead:
    """The places held for refused requests ahead of `request_id`: those due before
    its own (all, if it holds none); none with reservations off. Lapsed entries leave
    the line first. A place is ahead of another when it was told to come back first
    (by rank, between two told the same instant): each place's turn was forecast
    behind every place whose turn came before, so the room it waits for is there at
    its due, whoever of those behind it in rank is told to come back later. A
    bisection over the line's prefix sums, kept per version of the line (a new place
    due last extends them): the audit asks this of every refusal it watches at every
    step, and every refusal asks it once."""
    self._lapse(now)
    if not self.reserve or not self.reservations:
      return Ahead(0, 0, 0.0)
    if self._prefix[0] != self._line_version:
      order = sorted((held.due, held.rank, held.pages, held.turn)
                     for held in self.reservations.values())
      keys, pages, turns = [], [0], [0.0]
      for due, rank, held_pages, turn in order:
        keys.append((due, rank))
        pages.append(pages[-1] + held_pages)
        turns.append(max(turns[-1], turn))
      self._prefix = (self._line_version, keys, pages, turns)
    _, keys, pages, turns = self._prefix
    held = self.reservations.get(request_id)
    count = len(keys) if held is None else bisect.bisect_left(keys, (held.due, held.rank))
    return Ahead(count, pages[count], turns[count])

  def num_held(self, now: float) -> int:
    """Places held in line for refused requests, not yet lapsed (0 with reservations
    off: the line then shapes hints only)."""
    if not self.reserve:
      return 0
    return sum(held.expires >= now for held in list(self.reservations.values()))

  def release(self, request_id: str) -> None:
    """Its holder is admitted: the room is now its backlog."""
    if self.reservations.pop(request_id, None) is not None:
      self._line_version += 1

  # Estimates.
  def retry_after_pages(self, request: Request, num_pages: int, now: float,
                        queues: forecast.Queues) -> float:
    """The 503 hint for `request` (an estimate of `num_pages` pages); enters it in the
    line, or renews its place there."""
    if self.reserve:
      return self.retry_after_line(request, num_pages, now, queues)
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
    rank = self._rank_of(rid)
    self._hold(request, rank, num_pages, hint, now)
    return hint

  def retry_after_slots(self, request: Request, slots_short: int, now: float,
                        queues: forecast.Queues, estimate: int = 0) -> float:
    """The 429 hint: `slots_short` waiting-queue places missing, behind the clients told
    to come back before; a page reservation `request` holds is kept until then. (With
    reservations on: `retry_after_line`, `estimate` its page estimate.)"""
    if self.reserve:
      return self.retry_after_line(request, estimate, now, queues, queue_line=True)
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
      self._next_lapse = min(self._next_lapse, held.expires)
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
                           now: float, queues: forecast.Queues, *, limit_s: float = 0.0,
                           first_token: bool = False) -> float:
    """The hint for a newcomer (see `newcomer_eta`) whose forecast wait exceeds its
    deadline by `seconds_over`: the queue ahead of it drains a second per second, so
    then the wait would fit. (With reservations on: `retry_after_line`, the deadline
    `limit_s` on its first step, or with `first_token` on its first token.)"""
    if self.reserve:  # (every other line took it: its room is there, past the places)
      return self.retry_after_line(request, estimate, now, queues, limit_s=limit_s,
                                   first_token=first_token, behind_line=False)
    timeline, _ = self._newcomer_timeline(request, estimate, queues, now)
    return self._hint(seconds_over, timeline)

  def retry_after_line(self, request: Request, estimate: int, now: float,
                       queues: forecast.Queues, *, limit_s: float | None = None,
                       first_token: bool = False, behind_line: bool = True,
                       queue_line: bool = False) -> float:
    """The hint of a refusal with reservations on, whichever line refused: when the
    request's turn comes behind everything admitted and every place held ahead of it,
    and every line would take it then. It enters the line (or keeps its rank there)
    until it comes back, or its hint and `retry_grace_s` have passed.

    The forecast runs with it joining last, from the latest turn ahead of it (each
    place joins the forecast at its turn, not at its hint: the margins do not add up
    down the line). Its turn is the latest of: its page estimate fits
    above the line (the forecast admits it); the waiting queue has a place for it
    (`max_waiting`: as many ahead of it have left the queue); and with `limit_s`, its
    forecast first step (or with `first_token`, first token) would come within that
    many seconds of its return. The hint is its turn plus `LINE_MARGIN` of it and a
    step: each holder ahead returns late by its own margin, at most this one's.

    Without `behind_line` (a request refused only by its forecast first token or its
    deadline, checked once every other line took it: its pages fit past the places
    ahead of it), its turn is when the queue it met has drained enough, behind only
    the places ahead of it that those lines alone gave (`_first_token_places`).
    Behind the line's latest turn, a newcomer was told 10-30x the wait it needed, and
    a holder back on time was queued behind places whose holders never came back.
    Such refusals come few at a time: each runs its own forecast (a burst's, with its
    places joining at once, had the first one's prompt prefilled beside 31 others:
    0.42 s told for 0.03 s needed). On the TTFT line, the hint adds no step (see the
    comment below); a holder so refused keeps its due, where it stands in line. With
    `queue_line` (refused for a place in the waiting queue alone), its margin is half
    its turn or `QUEUE_STEP_SHARE` of a step, whichever is more."""
    rid = request.request_id
    rank = self._rank_of(rid)
    held = rid in self.reservations
    places = [] if behind_line else self._first_token_places(rid, now)
    if behind_line:  # not before those ahead
      joins = max(0.0, self.ahead(rid, now).latest_turn - now)
    else:
      joins = max((place.due for place in places), default=0.0)
    job = dataclasses.replace(forecast.job_of(request, estimate), due=joins, waiting=True)
    if held or not behind_line:  # back too early, refused by another line, or by its
      # first token alone (few, and each stands behind the last: no burst): its own run
      timeline = self._run(queues, now, rank=rank if behind_line else -1,
                           line_jobs=[*places, job], until=None if behind_line else rid)
      made, name = now, rid
    else:
      burst = self._burst_turn(job, queues, now, (limit_s, first_token))
      timeline, made, name = burst.timeline, burst.made, f"{NEWCOMER}{burst.taken - 1}"
    turn = None if timeline is None else self._turn(timeline, name, limit_s, first_token)
    if turn is not None:
      turn = max(0.0, turn - (now - made))
    if turn is not None and first_token and not behind_line:
      # The forecast-TTFT line takes the holder of a place back on time a step late
      # (`step_tolerance`): the step's margin is there already, and only the share of
      # the turn is stretched (a turn shorter than a step is common here: the line is
      # met as the step in flight runs down).
      hint = turn * (1.0 + LINE_MARGIN * self._spread())
    elif turn is not None and queue_line and timeline is not None:
      # Refused for a place in the waiting queue alone (its pages fit): a place opens
      # when a step launches, so the turn is often the rest of the step in flight,
      # priced to within a fraction of a step, and the place is the holder's until it
      # is back (the line counts it for everyone after). A whole step on top told 5-40x
      # the wait the audit found needed.
      hint = turn + self._spread() * max(LINE_MARGIN * turn,
                                         QUEUE_STEP_SHARE * timeline.seconds_per_step)
    else:
      seconds = None if timeline is None else (
          self.max_s if turn is None else turn * (1.0 + LINE_MARGIN))
      hint = self._hint(seconds, timeline, jitter_margin=True, cap=False)
    slack = 0
    if timeline is not None and turn is not None and timeline.seconds_per_step > 0:
      # What the running requests grow into while it comes back (the forecast had it
      # admitted at its turn, and their growth then dipping under the line, as growth
      # does), but never more than half the room the line keeps for growth. Refused by
      # a line on its first token alone, its pages were there already: from now.
      steps = math.ceil((hint - (turn if behind_line else 0.0)) / timeline.seconds_per_step)
      slack = min(int(self.watermark_pages // 2),
                  cdiv(steps * max(1, len(queues.running)), self.page_pool.page_size))
    # A place refused for pages first stays one (see `_first_token_places`).
    first_token_line = not behind_line and (
        not held or self.reservations[rid].first_token_line)
    self._hold(request, rank, estimate, hint, now, turn=now + (hint if turn is None else turn),
               slack_pages=slack, first_token_line=first_token_line,
               keep_due=held and not behind_line)
    # Past the cap, the client hears the cap, but its place stays due at its turn: back
    # early, it is told the rest.
    return min(self.max_s, hint)

  def _burst_turn(self, job: forecast.Job, queues: forecast.Queues, now: float,
                  line: tuple) -> "_Burst":
    """The forecast a new refusal of `job`'s shape reads its turn off, its place there
    taken (`NEWCOMER` + the index). One forecast prices `BURST` such places joining
    behind the whole line, and the next refusals of the same shape take them in turn
    for up to `BURST_TTL_S`, whatever steps run and holders are admitted meanwhile:
    those were in the forecast already, and its turns are read from when it was made.
    A change it did not foresee (a holder refused again, a place lapsed) ends it. A
    forecast runs every place in line, so one per step was most of the engine's time
    under a storm of a thousand places. `line` is what it is held to: (the limit on its
    first step or token, whether on its first token)."""
    shape = (job.prefill, job.samples_left, job.computed, job.estimate, line)
    burst = self._burst
    if (burst is None or burst.shape != shape or burst.taken == BURST
        or now - burst.made > BURST_TTL_S or burst.surprises != self._surprises):
      places = [dataclasses.replace(job, request_id=f"{NEWCOMER}{index}")
                for index in range(BURST)]
      burst = _Burst(shape, now, self._surprises, self._run(queues, now, line_jobs=places))
      self._burst = burst
    burst.taken += 1
    return burst

  def step_tolerance(self, request_id: str, now: float, queues: forecast.Queues) -> float:
    """For the holder of a place back on time (from its due to its lapse), the priced
    seconds of the steps in flight (else of one decode step of the running batch):
    where in a step a client lands, no hint can say, so a forecast-TTFT line takes it
    that much late. 0 for anyone else, and before steps are priced."""
    held = self.reservations.get(request_id) if self.reserve else None
    if held is None or not held.due <= now <= held.expires or not self.priced():
      return 0.0
    decode_costs, prefill_costs = self.costs.coefficients(False), self.costs.coefficients(True)
    assert decode_costs is not None and prefill_costs is not None
    seconds = sum(iterations * forecast.step_seconds(
        prefill_costs if tokens != num_sequences else decode_costs, tokens, context)
                  for _, tokens, context, num_sequences, iterations in queues.in_flight)
    if not seconds:
      context = sum(request.num_computed_tokens for request in queues.running)
      seconds = forecast.step_seconds(decode_costs, len(queues.running), context)
    return seconds

  def slack_pages(self, request_id: str, now: float) -> int:
    """Pages below the watermark the holder of a place may be admitted into, once its
    hint is due (see `Reservation.slack_pages`); 0 for anyone else."""
    held = self.reservations.get(request_id)
    return held.slack_pages if held is not None and held.due <= now <= held.expires else 0

  def _turn(self, timeline: forecast.Timeline, rid: str, limit_s: float | None,
            first_token: bool) -> float | None:
    """When every line would take `rid`, joining last in `timeline`; None if not
    before the horizon."""
    if rid not in timeline.admitted or rid not in timeline.scheduled:
      return None
    turn = timeline.admitted[rid]
    if self.max_waiting:
      position = timeline.departed.index(rid)  # how many waiting ones leave before it
      if position >= self.max_waiting:
        turn = max(turn, timeline.departures[position - self.max_waiting])
    if limit_s is not None:
      when = timeline.first_tokens.get(rid) if first_token else timeline.scheduled[rid]
      if when is None:
        return None
      turn = max(turn, when - limit_s)
    return turn

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
    # With the line held, its places join behind every admitted request, so they change
    # no admitted request's forecast (an ETA), and its cost does not grow with the line.
    self._forecast = (queues.key, now, self._run(queues, now, rank=-1 if self.reserve else None),
                      [])
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
    self._lapse(now)
    # With the line held, a newcomer's first step and token do not wait for its places:
    # their pages are kept at the KV line, and their holders, back later, queue behind
    # it. Without, the ledger's entries due before its first step come first.
    shape = (request.num_prompt_tokens, request.sampling.max_tokens, request.num_sampled,
             request.num_computed_tokens, estimate,
             None if self.reserve or rid not in self.reservations else rid)
    if shape not in by_shape:
      newcomer = dataclasses.replace(forecast.job_of(request, estimate), request_id=NEWCOMER,
                                     waiting=True)
      by_shape[shape] = (now, self._run(queues, now, newcomer, rid,
                                        rank=-1 if self.reserve else self._rank_of(rid)))
    made, timeline = by_shape[shape]
    return timeline, made

  def _run(self, queues: forecast.Queues, now: float, newcomer: forecast.Job | None = None,
           newcomer_id: str = "", *, rank: int | None = None,
           line_jobs: Sequence[forecast.Job] = (),
           until: str | None = None) -> forecast.Timeline | None:
    """The forecast of `queues` from `now` (`newcomer`, if given, queued last, its
    reservation not counted twice); None before both kinds of step are priced.

    With reservations on and a `rank`, only the places ranked ahead of it count, each
    joining at its turn (`rank=-1`: none of the line), and `line_jobs` (refused
    requests) join the line last, at their `due`. The forecast stops at the first token
    of `newcomer`, or of the line job named `until`."""
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
    line = [] if rank == -1 else [  # in rank order: a renewal keeps its slot
        (rid, held) for rid, held in self.reservations.items()
        if rid not in live and (rank is None or held.rank < rank)]
    reserved = [self._place_job(rid, held, now) for rid, held in line]
    reserved.extend(line_jobs)
    rules = forecast.Rules(decode_costs=decode_costs, prefill_costs=prefill_costs,
                           **self.rules)
    ends = now  # when the steps in flight are expected back, one after the other
    for start, tokens, context, num_sequences, iterations in queues.in_flight:
      costs = prefill_costs if tokens != num_sequences else decode_costs
      ends = max(ends, start) + iterations * forecast.step_seconds(costs, tokens, context)
    return forecast.run(rules, pool.num_free_pages, running, queue, reserved,
                        start_s=ends - now, until=NEWCOMER if newcomer is not None else until)

  def _place_job(self, rid: str, held: Reservation, now: float) -> forecast.Job:
    """A place in line as the forecast runs it: joining at its turn (at its due, with
    reservations off)."""
    return forecast.Job(rid, held.num_prompt_tokens, held.max_tokens, 0, 0, held.pages,
                        due=max(0.0, (held.turn if self.reserve else held.due) - now))

  def _first_token_places(self, request_id: str, now: float) -> list[forecast.Job]:
    """The places ranked ahead of `request_id` (all, for a request holding none) whose
    holders only a forecast-TTFT line or their own deadline refused, in rank order (at
    most the last `BURST`), as the forecast runs them: a refusal by those lines alone
    is told its turn behind them, so a burst of such refusals comes back one behind
    the other, not together to room for a few. (The lines themselves do not wait for
    these places: a check that did ran a forecast per arrival and per audited refusal,
    and stalled the engine for seconds under a storm of deadlines.)

    Only a place those lines gave a newcomer counts: a holder first refused for pages,
    back with them there and refused by the TTFT line, keeps its place as one for
    pages. Ahead by rank, not by due: such a holder stands ahead of every newcomer
    refused since. A place whose holder is not back by its latest hint and its margin
    (at least `FIRST_TOKEN_PLACE_LATE_S`) is left out: its client may have given up."""
    if not self.reserve:
      return []
    self._lapse(now)
    own = self.reservations.get(request_id)
    places = []
    for rid, held in self.reservations.items():  # (in rank order: see `_run`)
      told = held.expires - self.grace_s  # its latest hint's end (its due, unless kept)
      if (held.first_token_line and rid != request_id
          and (own is None or held.rank < own.rank)
          and now <= told + max(told - held.turn, FIRST_TOKEN_PLACE_LATE_S)):
        places.append(self._place_job(rid, held, now))
    return places[-BURST:]

  def _hint(self, seconds: float | None, timeline: forecast.Timeline | None, *,
            jitter_margin: bool = False, cap: bool = True) -> float:
    """`seconds` plus a step's margin, stretched by the jitter (with `jitter_margin`,
    only the margin is: a place in line is spread from those beside it by its turn
    already, and stretching the whole of a long wait would leave its room idle)."""
    spread = self._spread()
    if seconds is None or timeline is None:
      hint = self.default_s * spread
    elif jitter_margin:  # One step late rather than one early: an early client is refused.
      hint = seconds + timeline.seconds_per_step * spread
    else:
      hint = (seconds + timeline.seconds_per_step) * spread
    return min(self.max_s, hint) if cap else hint

  def _spread(self) -> float:
    """A seeded factor in [1, 1 + retry_jitter): hints to a burst do not all end at once."""
    return 1.0 + self.jitter * self._rng.random() if self.jitter else 1.0

  def _next_rank(self) -> int:
    self._num_ranked += 1
    return self._num_ranked - 1

  def _rank_of(self, request_id: str) -> int:
    """Its rank in the line, or the next one for a request holding no place."""
    held = self.reservations.get(request_id)
    return held.rank if held is not None else self._num_ranked

  def _hold(self, request: Request, rank: int, pages: int, hint: float, now: float, *,
            turn: float = 0.0, slack_pages: int = 0, first_token_line: bool = False,
            keep_due: bool = False) -> None:
    """Enters `request` in the line (or renews its place), due at `now + hint`; with
    `keep_due`, a renewed place keeps its earlier due, where it stands in line."""
    due = now + hint
    previous = self.reservations.get(request.request_id)
    if keep_due and previous is not None:
      due = min(due, previous.due)
    held = Reservation(rank, pages, due, now + hint + self.grace_s,
                       request.num_prompt_tokens, request.sampling.max_tokens, slack_pages,
                       turn, first_token_line)
    if request.request_id in self.reservations:  # refused again: told a new due
      self._surprises += 1
    version, keys, sums, turns = self._prefix
    appended = (request.request_id not in self.reservations
                and (not keys or keys[-1] < (held.due, rank)))
    if rank == self._num_ranked:
      self._next_rank()
    self.reservations[request.request_id] = held
    self._line_version += 1
    if appended and version == self._line_version - 1:  # due last: the sums grow by one
      keys.append((held.due, rank))
      sums.append(sums[-1] + pages)
      turns.append(max(turns[-1], turn))
      self._prefix = (self._line_version, keys, sums, turns)
    self._next_lapse = min(self._next_lapse, now + hint + self.grace_s)

  def _lapse(self, now: float) -> None:
    if now <= self._next_lapse:
      return
    lapsed = [rid for rid, held in self.reservations.items() if held.expires < now]
    for rid in lapsed:
      del self.reservations[rid]
    if lapsed:
      self._line_version += 1
      self._surprises += 1
    self._next_lapse = min((held.expires for held in self.reservations.values()),
                           default=math.inf)
