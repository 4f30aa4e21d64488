"""The wait forecast: the scheduler's next minutes, run ahead on the host.

Every "when" the server answers (a 503's or 429's retry hint, a waiting request's ETA)
is read off one forward run of the scheduler's own rules over what it holds now:

  * **running** requests compute their prefill chunks, then decode one token a step,
    growing into a page every `page_size` tokens, and free all their pages when their
    last token (`max_tokens`: a stop token can only end them sooner) is sampled;
  * the **queue** (swapped requests first, then waiting ones, first come first served)
    joins the batch while the token budget, `max_num_seqs` and free pages allow,
    trading its page estimate at the admission line for the pages it holds;
  * **reservations** (rejected requests told when to come back, in the order of their
    first rejection) join the queue from the moment they are due, once the admission
    check passes for them: free pages, less the rest of the running prompts' pages,
    less the queue's estimates, less the reservations ranked ahead, less their own
    estimate, above the watermark;
  * each step lasts what `kvpage.host.step_cost` says a step of that many tokens over
    that much context costs.

A pure-decode stretch (nothing to prefill, nothing that can join) is one jump to the
next request's end, so the forecast costs a few hundred steps of Python, not one per
simulated step. The run stops when everything in it has ended or at the horizon.

Under async scheduling a step is in flight when the forecast is made, and the
requests already count its tokens (each as pending): the forecast starts when that
step is expected to end (`run`'s `start_s`), not now, or every "when" would come one
step early.

What it returns is a `Timeline`: the room above the line after every forecast step,
and when each queued request and reservation is admitted, first scheduled, and
samples its next token (the end of the step that computes the last of its prompt). What it
leaves out: arrivals not yet seen, stop tokens (so ends come late, never early), and
preemption (admission keeps the watermark's pages for growth, so it is rare).

Pure Python: never imports jax.
"""

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

from kvpage.request import Request
from kvpage.units import cdiv


class Queues(NamedTuple):
  """What the scheduler holds, as the forecast reads it."""

  running: Sequence[Request]
  swapped: Sequence[Request]
  waiting: Sequence[Request]
  key: object  # changes whenever any of the three (or the pages they hold) may have
  # Steps launched but not back yet, in launch order: (earliest start, tokens, context
  # tokens, sequences, iterations), their work already counted in the requests.
  in_flight: Sequence[tuple[float, int, int, int, int]] = ()


@dataclasses.dataclass(slots=True)
class Job:
  """One request as the forecast runs it."""

  request_id: str
  prefill: int  # tokens to compute before its next sample; 0 while decoding
  samples_left: int  # tokens still to sample
  computed: int  # tokens whose keys and values are in the cache
  pages: int  # device pages it holds (swapped: the host pages it brings back)
  estimate: int  # pages it counts at the admission line until it runs
  due: float = 0.0  # a reservation: admissible from this many seconds from now
  waiting: bool = False  # in the waiting queue (a departure is counted when it runs)

  def owed_pages(self, page_size: int) -> int:
    """Pages a running job is certain to take before its next sample: the rest of its
    prompt (or of its recompute), beyond the pages it holds; 0 while decoding."""
    if not self.prefill:
      return 0
    return max(0, cdiv(self.computed + self.prefill, page_size) - self.pages)


def job_of(request: Request, estimate: int = 0) -> Job:
  """The forecast's view of `request` (running, queued or swapped)."""
  sampled, prompt = request.num_sampled, request.num_prompt_tokens
  computed = request.num_computed_tokens
  # Decoding when only the last sampled token lacks its keys and values.
  prefill = 0 if sampled and computed >= prompt + sampled - 1 else prompt + sampled - computed
  pages = len(request.page_ids) or len(request.host_page_ids)
  return Job(request.request_id, prefill, max(0, request.sampling.max_tokens - sampled),
             computed, pages, estimate)


@dataclasses.dataclass
class Timeline:
  """A forecast: times are seconds from the moment it was made."""

  times: list[float]  # after each forecast step (and at 0)
  # free - running prompts' owed pages - queue estimates - unadmitted reservations
  rooms: list[int]
  admitted: dict[str, float]  # reservation -> when it passed the admission check
  scheduled: dict[str, float]  # queued request or reservation -> when it first ran
  # request -> when the step that computes the last of its prompt ends: its next token
  first_tokens: dict[str, float]
  departed: list[str]  # who left the waiting queue (was first scheduled), in order
  ends: list[tuple[float, str]]  # (when, request id) of each request it ends, in order
  seconds_per_step: float  # mean forecast step

  @property
  def departures(self) -> list[float]:
    """When each of `departed` left the waiting queue, in order."""
    return [self.scheduled[rid] for rid in self.departed]

  def first_room(self, pages: float, taken: Sequence[tuple[float, int]] = ()) -> float | None:
    """Seconds until the room above everything forecast (less `taken`: (until when,
    pages) held by requests rejected since the forecast) is at least `pages`; None
    past the horizon. Room grows only when a step ends something, so the steps'
    ends and the ends of `taken` are the only moments to look at."""
    ends = sorted(taken)
    candidates = sorted({*self.times, *(end for end, _ in ends if end >= 0)})
    for when in candidates:
      index = bisect.bisect_right(self.times, when) - 1
      held = sum(held_pages for end, held_pages in ends if end > when)
      if self.rooms[index] - held >= pages:
        return when
    return None


@dataclasses.dataclass(frozen=True)
class Rules:
  """The scheduler's knobs that the forecast obeys, and the step's price."""

  max_num_batched_tokens: int
  chunk_size: int  # 0: only the budget caps a chunk
  max_num_seqs: int
  chunked: bool  # prefill_policy "chunked" (else "none": whole prompts, before decodes)
  page_size: int
  watermark_pages: float
  # Seconds per step, per token and per context token, and the least a step costs, of
  # decode-only steps and of steps that carry prefill tokens (`StepCostModel`).
  decode_costs: tuple[float, float, float, float]
  prefill_costs: tuple[float, float, float, float]
  horizon_s: float


def run(rules: Rules, free_pages: int, running: list[Job], queue: list[Job],
        reserved: list[Job], start_s: float = 0.0, until: str | None = None) -> Timeline:
  """Forecasts the scheduler from now (see the module docstring), its first step
  starting `start_s` from now (when the steps in flight end). `queue` in the order it
  is served (swapped first), `reserved` in rank order; all three are consumed. With
  `until`, the forecast stops once that request has its first token: what comes
  after (later ends, departures) is not in the timeline."""
  return _Run(rules, free_pages, running, queue, reserved, start_s).timeline(until)


def step_seconds(costs: tuple[float, float, float, float], num_tokens: int,
                 num_context_tokens: int) -> float:
  """One step's seconds at `costs` (launch, per token, per context token, floor)."""
  launch, per_token, per_context, floor = costs
  return max(floor, launch + per_token * num_tokens + per_context * num_context_tokens)


class _Run:
  """The state of one forecast as it steps."""

  def __init__(self, rules: Rules, free_pages: int, running: list[Job], queue: list[Job],
               reserved: list[Job], start_s: float = 0.0):
    self.rules, self.free = rules, free_pages
    self.running, self.queue, self.reserved = running, queue, reserved
    self.queue_charge = sum(job.estimate for job in queue)
    self.reserved_charge = sum(job.estimate for job in reserved)
    self.chunk = rules.chunk_size or rules.max_num_batched_tokens
    self.out = Timeline([0.0], [self.room()], {}, {}, {}, [], [], 0.0)
    self.start_s = self.now = start_s  # nothing changes before the steps in flight end
    self.num_steps = 0

  def room(self) -> int:
    """The admission line's view: free pages less the rest of the running prompts (a
    chunked prompt takes them for certain) and the estimates of the queue and the
    unadmitted reservations."""
    return self.free - self.owed() - self.queue_charge - self.reserved_charge

  def owed(self) -> int:
    return sum(job.owed_pages(self.rules.page_size) for job in self.running)

  def timeline(self, until: str | None = None) -> Timeline:
    while ((self.running or self.queue or self.reserved) and self.now <= self.rules.horizon_s
           and (until is None or until not in self.out.first_tokens)):
      self.admit_reservations()
      if not self.step():
        upcoming = [job.due for job in self.reserved if job.due > self.now]
        if not upcoming:
          break  # nothing runs and nothing will: the forecast cannot see further
        self.now = min(upcoming)
    out = self.out
    launch, per_token, _, floor = self.rules.decode_costs
    out.seconds_per_step = ((self.now - self.start_s) / self.num_steps if self.num_steps
                            else max(floor, launch + per_token))
    return out

  def admit_reservations(self) -> None:
    """Due reservations that pass the admission check join the queue, in rank order."""
    ahead, left = 0, self.free - self.owed()
    for job in list(self.reserved):
      if job.due <= self.now and (left - self.queue_charge - ahead - job.estimate
                                  >= self.rules.watermark_pages):
        self.reserved.remove(job)
        self.reserved_charge -= job.estimate
        self.queue_charge += job.estimate
        job.waiting = True
        self.queue.append(job)
        self.out.admitted[job.request_id] = self.now
      else:
        ahead += job.estimate

  def step(self) -> bool:
    """One forecast step, or a jump over a stretch of identical decode steps; False
    if nothing could run."""
    rules = self.rules
    self.end_finished()
    decoding = [job for job in self.running if not job.prefill and job.samples_left > 0]
    prefill_only = not rules.chunked and self.queue_can_join(rules.max_num_batched_tokens)
    chunks: list[tuple[Job, int]] = []
    budget = rules.max_num_batched_tokens
    if not prefill_only:
      chunks = [(job, 1) for job in decoding]
      budget -= len(decoding)
      for job in self.running:
        if job.prefill and budget > 0:
          chunks.append((job, min(job.prefill, budget, self.chunk)))
          budget -= chunks[-1][1]
      for job, n in chunks:  # pages before the queue's heads may join, as the scheduler
        self.grow(job, job.computed + n)
    if prefill_only or rules.chunked:
      budget = self.join_from_queue(chunks, budget)
    if not chunks:
      return False
    num_steps = 1
    if len(chunks) == len(decoding) and not self.queue_can_join(budget):
      num_steps = self.stretch(decoding)
    self.advance(chunks, num_steps)
    return True

  def queue_can_join(self, budget: int) -> bool:
    if not self.queue or budget <= 0 or len(self.running) >= self.rules.max_num_seqs:
      return False
    head = self.queue[0]
    tokens = head.prefill or 1
    if not self.rules.chunked and tokens > budget:
      return False
    pages = cdiv(head.computed + min(tokens, budget, self.chunk), self.rules.page_size)
    return pages - head.pages <= self.free

  def join_from_queue(self, chunks: list[tuple[Job, int]], budget: int) -> int:
    """The queue's heads join while budget, sequences and pages allow (FCFS)."""
    while self.queue_can_join(budget):
      job = self.queue.pop(0)
      tokens = min(job.prefill or 1, budget, self.chunk)
      self.queue_charge -= job.estimate
      self.free -= job.pages  # a swapped request's pages come back first
      self.grow(job, job.computed + tokens)
      self.running.append(job)
      self.out.scheduled[job.request_id] = self.now
      if job.waiting:
        self.out.departed.append(job.request_id)
      chunks.append((job, tokens))
      budget -= tokens
    return budget

  def grow(self, job: Job, num_tokens: int) -> None:
    pages = cdiv(num_tokens, self.rules.page_size)
    if pages > job.pages:
      self.free -= pages - job.pages
      job.pages = pages

  def stretch(self, decoding: list[Job]) -> int:
    """Steps of the same decode batch until the next end or the next reservation due."""
    steps = min(job.samples_left for job in decoding)
    upcoming = [job.due for job in self.reserved if job.due > self.now]
    if upcoming and steps > 1:
      launch, per_token, per_context, floor = self.rules.decode_costs
      context = sum(job.computed for job in decoding) + steps * len(decoding)
      slowest = max(floor, launch + per_token * len(decoding) + per_context * context)
      if slowest > 0:
        steps = min(steps, max(1, math.ceil((min(upcoming) - self.now) / slowest)))
    return max(1, steps)

  def advance(self, chunks: list[tuple[Job, int]], num_steps: int) -> None:
    """Runs `chunks` `num_steps` times (more than once only for pure decodes)."""
    tokens = sum(n for _, n in chunks)
    launch, per_token, per_context, floor = (
        self.rules.decode_costs if tokens == len(chunks)
        and not any(job.prefill for job, _ in chunks) else self.rules.prefill_costs)
    context = sum(job.computed + n for job, n in chunks)
    first = launch + per_token * tokens + per_context * context
    # Each repeated decode step attends to one more token per sequence; under the
    # floor, every step costs the floor.
    if first + per_context * tokens * (num_steps - 1) <= floor:
      self.now += num_steps * floor
    else:
      self.now += num_steps * max(floor, first) + (
          per_context * tokens * num_steps * (num_steps - 1) / 2)
    self.num_steps += num_steps
    for job, n in chunks:
      computed = job.computed + n * num_steps
      if job.prefill:
        job.prefill -= n
        if not job.prefill:
          job.samples_left -= 1
          self.out.first_tokens.setdefault(job.request_id, self.now)
      else:
        job.samples_left -= num_steps
      job.computed = computed
      self.grow(job, computed)
    self.end_finished()
    self.out.times.append(self.now)
    self.out.rooms.append(self.room())

  def end_finished(self) -> None:
    """Ends free their pages; so does a request whose last token was already in flight."""
    for job in [job for job in self.running if job.samples_left <= 0 and not job.prefill]:
      self.running.remove(job)
      self.free += job.pages
      self.out.ends.append((self.now, job.request_id))
