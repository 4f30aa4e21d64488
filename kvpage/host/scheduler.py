"""Continuous batching over a paged KV cache: what runs at each step, and who waits.

Every step (iteration-level scheduling, Orca OSDI'22) the scheduler rebuilds the
batch: running requests continue, waiting ones join while the token budget
(`max_num_batched_tokens`) and the running-set cap (`max_num_seqs`) allow, and
finished ones leave at once. Requests flow between three queues:

  waiting (admitted, no pages) ──► running (device pages) ──► finished
      ▲   recompute preemption        │  swap preemption
      └───────────────────────────────┤──► swapped (host pages) ──► running
                                      └──► finished("preempted") under abort

Two prefill policies decide the order within a step:
  * `none`: prompts are prefilled whole and first; a step that admits prefills runs
    no decodes, so running requests stall behind long prompts — vLLM's
    prefill-prioritizing schedule, the baseline of Sarathi-Serve (OSDI'24).
  * `chunked`: decodes are scheduled first (one token each) and prefill chunks of at
    most `chunk_size` tokens fill the rest of the budget: Sarathi-Serve's stall-free
    batching.

When a running request needs a page and none is free, the least important running
request is preempted (`_preempt`): the largest priority value (lower = more
important, as in vLLM), the newest among equals — the newest has the least sunk work
and the most remaining wait tolerance (vLLM's FCFS recompute order, SOSP'23 section
4.5). A running request never fails because another one grew: it either gets its page
or is itself the least important request. The three modes (`preemption_mode`):

  * **recompute**: free its pages; it re-enters the *front* of the waiting queue and
    later prefills prompt + generated tokens again in one pass. Cheap when prompts
    are short: recomputing is a compute-bound prefill, faster than re-decoding.
  * **swap**: copy its pages to the host pool and resume it, before any waiting
    request, once device pages free up; the step output lists the page copies. When
    the host pool cannot take it, it falls back to recompute. A swapped request keeps
    the leading pages it shares on the device; if, with nothing running, those block
    the resume of a more important one, it is requeued for recompute (`_unpin_for`).
  * **abort**: finish it with reason `"preempted"` — for deployments that prefer a
    fast error over a slow answer.

With `num_decode_steps > 1` (multi-step decoding, vLLM's multi-step scheduling) a
step that is all decodes, while nothing waits or sits swapped, becomes one launch of
up to that many decode iterations: each request's pages for all of them are reserved
at once (or, if they do not fit, the step stays single rather than preempt for
lookahead), and its tokens come back together. Fewer launches, less host work per
token; a request arriving meanwhile waits for the launch to end.

The scheduler never touches device arrays: `SchedulerOutput` lists token ids,
positions, page tables and page copies; `kvpage.batch` turns them into arrays.
Pure Python: never imports jax.
"""

import collections
import copy
import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import ml_collections

from kvpage.host import multi_step, prefix_cache, scheduler_config
from kvpage.host.admission import AdmissionControl
from kvpage.host.forecast import Queues
from kvpage.host.pages import PagePool
from kvpage.host.retry_audit import RetryAudit
from kvpage.interface import (
  TOO_MANY_REQUESTS,
  Admission,
  Preemption,
  ScheduledSequence,
  SchedulerOutput,
  make_sequence,
  tokens_of,
)
from kvpage.request import Request, RequestStatus

__all__ = ["Admission", "Preemption", "ScheduledSequence", "Scheduler", "SchedulerOutput"]

_RUNNING = RequestStatus.RUNNING
# A request whose prompt alone, on an idle engine, takes more than 1/IDLE_ALLOWANCE of
# `max_forecast_ttft_s` to its first token is held to IDLE_ALLOWANCE x that time instead
# (a slowdown line for long prompts only), so a fixed line never refuses it for good.
IDLE_ALLOWANCE = 2.0


class Scheduler:
  """Admission, continuous batching, chunked prefill and preemption over a PagePool."""

  def __init__(self, config: ml_collections.ConfigDict, *, num_pages: int, page_size: int,
               max_model_len: int, num_host_pages: int | None = None,
               clock: Callable[[], float] = time.monotonic, vocab_size: int | None = None,
               prefix_caching: bool = False):
    scheduler_config.check(config, max_model_len)
    self.config = config
    self.max_model_len = max_model_len
    self.clock = clock
    host = config.num_host_pages if num_host_pages is None else num_host_pages
    self.page_pool = PagePool(num_pages, page_size, host, prefix_caching=prefix_caching)
    self.admission = AdmissionControl(config, self.page_pool, max_model_len, vocab_size)
    # Were the hints honest? Recent refusals, checked at every step's end (0: off).
    self.audit = RetryAudit(config.retry_audit) if config.get("retry_audit") else None
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.swapped: list[Request] = []
    self.requests: dict[str, Request] = {}  # every admitted, unfinished request
    self._finished: list[Request] = []  # since the last output
    self._rejected: list[Admission] = []
    self._step = 0
    self._num_admitted = 0
    self._num_joins = 0  # queue joins, withdrawn ones included: the forecast's key
    # (deadline, admission index, request) of admitted requests with a max_queue_wait_s.
    self._deadlines: list[tuple[float, int, Request]] = []
    self._num_finished = 0
    self._preemptions = dict.fromkeys(scheduler_config.PREEMPTION_MODES, 0)
    self._rejections = {400: 0, 429: 0, 503: 0}
    # Per-step state, reset by `schedule`.
    self._scheduled: dict[str, ScheduledSequence] = {}
    self._budget = 0
    self._chunk_size = config.chunk_size or config.max_num_batched_tokens
    # Launched steps not yet updated: step -> (scheduled at, tokens, context tokens,
    # sequences, iterations), priced for the wait estimator when their samples return.
    self._launched: dict[int, tuple[float, int, int, int, int]] = {}
    self._last_update = float("-inf")
    # Whether the scheduler has had work since the last step came back: the host's time
    # between that return and the next launch (outputs handed over, arrivals answered,
    # the batch scheduled) is then part of what the next step costs.
    self._busy_since_update = False
    # The last priced launch: (step, seconds from the previous step's return, when the
    # scheduler was busy since or launches overlap, else from its launch, to its
    # samples). What `steps.jsonl` records.
    self.last_step_time: tuple[int, float] | None = None

  # Arrivals and departures.
  def add_request(self, request: Request) -> Admission:
    """Answers an arrival: 200 admitted (queued), or 400/429/503 with a reason.

    A rejected request ends `REJECTED` with the answer in its log, reported once in the
    next output's `rejected`. An id held by a live request is a 400; the live request
    is left untouched even when `request` is that very object (a resubmission).
    """
    now = self.clock()
    live = self.requests.get(request.request_id)
    if live is request:
      answer = self._duplicate(request)
      self._count_rejection(answer)
      return answer
    if request.arrival_time is None:
      request.arrival_time = now
    request.log(now, "queued", num_prompt_tokens=request.num_prompt_tokens,
                max_tokens=request.sampling.max_tokens, priority=request.priority)
    answer = self._duplicate(request) if live is not None else self._answer(request, now)
    if not answer.admitted:
      request.status = RequestStatus.REJECTED
      request.log(now, "rejected", status=answer.status, reason=answer.reason,
                  retry_after=answer.retry_after)
      self._count_rejection(answer)
      if self.audit is not None:
        self.audit.note(request, answer, now)
      return answer
    self.admission.wait.release(request.request_id)  # its place in line, if it held one
    self._join(request)
    self._num_admitted += 1
    if self.audit is not None and self.audit.num_open:
      self.audit.admitted(request.request_id, now)  # a retry under the refused id
    if request.max_queue_wait_s is not None:
      heapq.heappush(self._deadlines, (request.arrival_time + request.max_queue_wait_s,
                                       request.admission_index, request))
    request.log(now, "admitted", estimated_pages=self.admission.estimate_pages(request))
    return answer

  def _answer(self, request: Request, now: float) -> Admission:
    """Every line's answer to `request` arriving now: admission's, then the forecast's
    (a deadline of its own, or the server's forecast-TTFT lines)."""
    answer = self.admission.decide(request, now, self._queues())
    if answer.admitted and (request.max_queue_wait_s is not None
                            or self.config.max_forecast_ttft_s or self.config.max_ttft_slowdown):
      answer = self._check_deadline(request, answer, now)
    return answer

  def _join(self, request: Request) -> None:
    """Puts an admitted request at the end of the waiting queue, its estimate in the backlog."""
    request.status = RequestStatus.WAITING
    request.admission_index = self._num_admitted
    self._num_joins += 1
    self.requests[request.request_id] = request
    self.waiting.append(request)
    self.admission.add_backlog(request)

  def _check_deadline(self, request: Request, answer: Admission, now: float) -> Admission:
    """`answer`, or a 429 if the forecast, with `request` queued last, has it wait for
    its first step longer than its `max_queue_wait_s` (from its arrival), or, when it
    names none, has its first token come later than the forecast-TTFT lines allow:
    `max_forecast_ttft_s`, and `max_ttft_slowdown` times its time to first token on an
    idle engine. A prompt that alone would take more than half of `max_forecast_ttft_s`
    is held to `IDLE_ALLOWANCE` x its idle time instead: a line in seconds must not
    refuse, on every try, a long prompt the server can serve."""
    wait, queues = self.admission.wait, self._queues()
    waited = now - cast(float, request.arrival_time)
    own = request.max_queue_wait_s is not None
    if not own and not wait.priced():
      return answer  # The server's lines refuse on a forecast, and there is none yet.
    estimate = self.admission.estimate_pages(request)
    first_step, first_token = wait.newcomer_eta(request, estimate, now, queues)
    if own:
      forecast_s, limit = waited + first_step, cast(float, request.max_queue_wait_s)
      what = (f"forecast wait {forecast_s:.2f} s exceeds the request's max_queue_wait_s "
              f"{limit:g} s")
    else:
      forecast_s, idle = waited + first_token, wait.idle_first_token_s(request)
      limits = []
      line = self.config.max_forecast_ttft_s
      if line and IDLE_ALLOWANCE * idle > line:
        limits.append((IDLE_ALLOWANCE * idle,
                       f"{IDLE_ALLOWANCE:g} x this request's {1e3 * idle:.1f} ms on an idle "
                       f"engine (its own prompt is too long for the server's "
                       f"max_forecast_ttft_s {line:g} s)"))
      elif line:
        limits.append((line, f"the server's max_forecast_ttft_s {line:g} s"))
      if self.config.max_ttft_slowdown:
        limits.append((self.config.max_ttft_slowdown * idle,
                       f"max_ttft_slowdown {self.config.max_ttft_slowdown:g} x this "
                       f"request's {1e3 * idle:.1f} ms on an idle engine"))
      limit, name = min(limits)
      # A holder back at its place's due was forecast to meet the line at its turn; it
      # cannot aim at the part of a step it lands in, so it is held to the line a step
      # later.
      step = wait.step_tolerance(request.request_id, now, queues)
      if step:
        limit += step
        name += f" + a step ({1e3 * step:.1f} ms) for a place in line back on time"
      what = f"forecast time to first token {forecast_s:.3f} s exceeds {name}"
    if forecast_s <= limit:
      return answer
    return Admission(TOO_MANY_REQUESTS, what,
                     self.admission.hint(wait.retry_after_deadline, request, estimate,
                                         forecast_s - limit, now, queues,
                                         limit_s=limit - waited, first_token=not own),
                     request.request_id, "wait_deadline" if own else "wait_forecast")

  def would_admit(self, request: Request) -> bool:
    """Whether `request`, arriving now, would be admitted: every line `add_request`
    holds, without its side effects (no hint computed, no rate-limit token spent,
    nothing queued or logged). What the retry audit asks of a refused request."""
    now = self.clock()
    probe = copy.copy(request)  # a retry is a new arrival
    probe.arrival_time = now
    with self.admission.probing():
      return self._answer(probe, now).admitted

  def deadline_retry_after(self, request: Request) -> float:
    """The retry hint for `request`, which ended because its `max_queue_wait_s` passed
    while it waited: when a retry of it, queued last now, is forecast to be scheduled
    within the same deadline (the hint of a refusal at the door, `_check_deadline`)."""
    now, queues, wait = self.clock(), self._queues(), self.admission.wait
    estimate = self.admission.estimate_pages(request)
    first_step, _ = wait.newcomer_eta(request, estimate, now, queues)
    limit = cast(float, request.max_queue_wait_s)
    return wait.retry_after_deadline(request, estimate, max(0.0, first_step - limit), now,
                                     queues, limit_s=limit)

  @staticmethod
  def _duplicate(request: Request) -> Admission:
    return Admission(400, f"duplicate request_id {request.request_id!r}: a live request "
                     "holds it", None, request.request_id, "duplicate_request_id")

  def _count_rejection(self, answer: Admission) -> None:
    self._rejections[answer.status] += 1
    self._rejected.append(answer)

  def abort(self, request_id: str, reason: str = "aborted") -> bool:
    """Ends a request in any state and frees all it holds; False if it is not live.

    `reason` is its finish reason: a gateway that matched a stop string on the text
    ends the request with "stop".
    """
    request = self.requests.get(request_id)
    if request is None:
      return False
    now = self.clock()
    request.log(now, "aborted", status=request.status.value, reason=reason)
    self._finish(request, reason, now)
    return True

  def _expire_deadlines(self, now: float) -> None:
    """Ends ("deadline") each request still waiting for its first step past its deadline."""
    while self._deadlines and self._deadlines[0][0] <= now:
      _, _, request = heapq.heappop(self._deadlines)
      # Only recompute preemption sends a scheduled request back to WAITING, and it counts.
      if (request.status is RequestStatus.WAITING and request.num_preemptions == 0
          and self.requests.get(request.request_id) is request):
        self._finish(request, "deadline", now)

  # The step.
  def schedule(self) -> SchedulerOutput:
    """Decides the next step's batch; see the module docstring for the order."""
    self._step += 1
    if self._deadlines:
      self._expire_deadlines(self.clock())
    # Requests finished this step (abort-mode preemption) join those finished since
    # the last output, so each finished request is reported exactly once.
    out = SchedulerOutput(step=self._step, finished=self._finished, rejected=self._rejected)
    self._rejected = []
    self._scheduled = {}
    self._budget = self.config.max_num_batched_tokens
    if self.config.prefill_policy == "chunked":
      self._schedule_running(out, decodes=True)
      self._schedule_running(out, decodes=False)
      if not out.preempted:
        self._resume_swapped(out)
        self._admit_waiting(out)
    else:
      self._admit_waiting(out)
      if not self._scheduled:  # a step with prefills runs no decodes: they stall
        self._schedule_running(out, decodes=True)
        if not out.preempted:
          self._resume_swapped(out)
    out.scheduled = list(self._scheduled.values())
    if not out.scheduled:  # the wait until the next launch is idle, not the host's work
      self._busy_since_update = False
    out.num_batched_tokens = self.config.max_num_batched_tokens - self._budget
    self._finished = []
    multi_step.extend_decodes(
        out, self.page_pool, num_decode_steps=self.config.num_decode_steps,
        max_model_len=self.max_model_len,
        nothing_else_waits=self._budget > 0 and not self.waiting and not self.swapped)
    for seq in out.scheduled:  # Committed: the next schedule() may come before update().
      seq.request.num_computed_tokens = seq.start_position + len(seq.token_ids) + (
          seq.num_steps - 1)
      seq.request.num_pending += seq.samples * seq.num_steps
    self._note_launch(out)
    return out

  def _note_launch(self, out: SchedulerOutput) -> None:
    """Keeps what the step computes, to price it once its samples return (`update`)."""
    if out.scheduled:
      iterations = max(seq.num_steps for seq in out.scheduled)
      context = sum(seq.start_position + len(seq.token_ids) + (seq.num_steps - 1) / 2
                    for seq in out.scheduled)
      start = self._last_update if self._busy_since_update else self.clock()
      self._launched[out.step] = (start, out.num_batched_tokens, round(context),
                                  len(out.scheduled), iterations)

  def _price_step(self, output: SchedulerOutput) -> None:
    """A step's samples are back: its time, from the previous step's return (when the
    scheduler was busy since, or launches overlap; else from its launch) to now, teaches
    the wait estimator what steps cost. The host's work between steps counts: under a
    storm of refusals it was a fifth of the tiny server's time, and a forecast of
    device time alone told clients to come back too early."""
    launched = self._launched.pop(output.step, None)
    if launched is None:
      return
    now = self.clock()
    start, tokens, context, num_sequences, iterations = launched
    seconds = now - max(start, self._last_update)
    self.last_step_time = (output.step, seconds)
    self._last_update = now
    self.admission.wait.observe_step(tokens, context, num_sequences, seconds / iterations)

  def update(self, output: SchedulerOutput,
             sampled: Mapping[str, int | Sequence[int]]) -> list[Request]:
    """Records a step's samples: appends each token, ends requests that are done.

    `sampled` maps each sampling sequence to its token, or for a multi-step decode to
    its `num_steps` tokens in order; tokens after a stop token are void.

    `schedule()` already advanced every scheduled request past the step, so under async
    scheduling the next step may be scheduled (with pending tokens as placeholders)
    before this runs. A sample for a request that finished meanwhile (aborted, or it
    hit a stop token in the previous step) is void; one for a request preempted
    meanwhile still counts: the step that sampled it ran with the request's pages.
    """
    self._price_step(output)
    finished = []
    now = None
    for seq in output.scheduled:
      request = seq.request
      if not seq.samples or request.status is RequestStatus.FINISHED:
        continue
      try:
        tokens = tokens_of(sampled[seq.request_id])
      except KeyError:
        raise ValueError(f"no sampled token for {seq.request_id!r}") from None
      if len(tokens) != seq.num_steps:
        raise ValueError(f"{seq.request_id!r} ran {seq.num_steps} decode iterations but "
                         f"{len(tokens)} tokens came back")
      if request.num_pending < len(tokens):
        raise ValueError(f"update() for step {output.step} finds no pending token of "
                         f"{request.request_id!r}: was it applied twice?")
      if now is None:
        now = self.clock()
      for token in tokens:  # Tokens after a stop token are void.
        request.num_pending -= 1
        request.output_ids.append(token)
        if len(request.output_ids) == 1:
          request.log(now, "first_token")
        reason = request.stop_reason(token)
        if reason is not None:
          self._finish(request, reason, now)
          finished.append(request)
          break
    if self.page_pool.prefix is not None:
      self._name_computed_pages(output)
    if self.audit is not None and self.audit.num_open:
      self.audit.probe(self.clock(), self.would_admit)
    self._busy_since_update = bool(self.requests)
    return finished

  def _name_computed_pages(self, output: SchedulerOutput) -> None:
    """Prefix caching: names the full pages of the step's requests whose tokens are all
    known and whose keys and values launched steps have written (or are writing: a
    later step that shares them runs after, in launch order)."""
    page_size = self.page_pool.page_size
    for seq in output.scheduled:
      request = seq.request
      if request.status is not _RUNNING:
        continue  # finished or preempted since: its pages are not its own any more
      known = request.num_prompt_tokens + request.num_output_tokens
      num_pages = min(known, request.num_computed_tokens) // page_size
      hashes = prefix_cache.request_hashes(request, num_pages * page_size, page_size)
      self.page_pool.name_pages(request.request_id, hashes, num_pages)

  # Read-outs.
  @property
  def num_running(self) -> int:
    return len(self.running)

  @property
  def num_waiting(self) -> int:
    return len(self.waiting)

  @property
  def num_swapped(self) -> int:
    return len(self.swapped)

  def has_unfinished(self) -> bool:
    return bool(self.requests)

  def eta(self, request_id: str, *, first_token: bool = False) -> float | None:
    """Seconds until a live request that waits (or sits swapped) should be scheduled, or
    with `first_token` sample its first token (a preempted one: its next; what a waiting
    client is told); 0 once it runs, None for an id that is not live. From the same
    estimator as the retry hints: a deadline check belongs here, comparing a request's
    deadline with its ETA."""
    request = self.requests.get(request_id)
    if request is None:
      return None
    if request.status is _RUNNING:
      return 0.0
    return self.admission.wait.eta(request, self.clock(), self._queues(),
                                   first_token=first_token)

  def _queues(self) -> Queues:
    """The queues as the wait forecast reads them, and the steps in flight (each starts
    when it was launched or when the step before it came back, the later); the key
    changes whenever the running set, the backlog, the pages they hold or the steps in
    flight may have."""
    in_flight = [(max(launched, self._last_update), tokens, context, num_sequences, iterations)
                 for launched, tokens, context, num_sequences, iterations
                 in self._launched.values()]
    return Queues(self.running, self.swapped, self.waiting,
                  (self._step, self._num_finished, sum(self._preemptions.values()),
                   self._num_joins, tuple(self._launched)), in_flight)

  def stats(self) -> dict[str, Any]:
    """Counters and gauges for the metrics module: usage, queues, preemptions, rejections."""
    pool = self.page_pool
    return dict(
        step=self._step, num_running=self.num_running, num_waiting=self.num_waiting,
        num_swapped=self.num_swapped, kv_usage=pool.usage, num_free_pages=pool.num_free_pages,
        num_used_pages=pool.num_used_pages, num_usable_pages=pool.num_usable_pages,
        host_usage=pool.host_usage, num_free_host_pages=pool.num_free_host_pages,
        num_backlog_pages=self.admission.num_backlog_pages, num_admitted=self._num_admitted,
        num_finished=self._num_finished, preemptions=dict(self._preemptions),
        num_preemptions=sum(self._preemptions.values()), rejections=dict(self._rejections),
        num_rejections=sum(self._rejections.values()),
        prefix_caching=pool.prefix is not None, num_cached_pages=pool.num_cached_pages,
        num_evictable_pages=pool.num_evictable_pages,
        **({f"prefix_{k}": v for k, v in pool.prefix.stats.to_dict().items()}
           if pool.prefix is not None else {}))

  # Internals: the three queues feeding the batch.
  def _schedule_running(self, out: SchedulerOutput, *, decodes: bool) -> None:
    """Continues running requests: decodes (one token) or prefill chunks."""
    for request in list(self.running):
      if self._budget <= 0:
        return
      if request.status is not _RUNNING:
        continue  # preempted earlier in this step
      remaining = request.num_tokens - request.num_computed_tokens
      if (remaining == 1) is not decodes:
        continue
      if request.num_sampled >= request.sampling.max_tokens:
        continue  # Its last token is in flight (async scheduling): nothing more to compute.
      num_new = 1 if decodes else min(remaining, self._budget, self._chunk_size)
      if self._reserve_pages(request, request.num_computed_tokens + num_new, out):
        self._add(request, num_new)

  def _resume_swapped(self, out: SchedulerOutput) -> None:
    """Swaps preempted requests back in, most important first, while pages allow."""
    pool = self.page_pool
    while self.swapped and len(self.running) < self.config.max_num_seqs and self._budget > 0:
      request = min(self.swapped, key=importance)
      num_new = self._num_new_prefill(request)
      target = request.num_computed_tokens + num_new
      # Beyond its host pages and the shared pages it kept on the device.
      extra = pool.pages_for(target) - len(request.host_page_ids) - len(request.page_ids)
      if num_new == 0 or not (pool.can_swap_in(request.request_id, extra)
                              or self._unpin_for(request, extra)):
        return
      out.swap_in.extend(pool.swap_in(request.request_id))
      pool.grow_to(request.request_id, target)
      self.swapped.remove(request)
      self.admission.remove_backlog(request)
      request.page_ids, request.host_page_ids = pool.page_table(request.request_id), []
      request.status = _RUNNING
      self.running.append(request)
      request.log(self.clock(), "swapped_in", num_pages=len(request.page_ids))
      self._add(request, num_new)

  def _unpin_for(self, head: Request, extra: int) -> bool:
    """When nothing runs, no page will ever free up but those swapped requests keep on
    the device (leading pages they shared when swapped out): if those stop `head`, the
    most important swapped request, from resuming, the scheduler would stall for good.
    Requeues the less important keepers for recompute, least important first, until
    `head` fits; returns whether it does."""
    pool = self.page_pool
    if self.running:
      return False  # Running requests finish and free their pages: wait for them.
    keepers = sorted((r for r in self.swapped if r is not head and r.page_ids),
                     key=importance, reverse=True)
    for victim in keepers:
      if pool.can_swap_in(head.request_id, extra):
        break
      self.swapped.remove(victim)
      self.admission.remove_backlog(victim)
      victim.host_page_ids = []
      victim.log(self.clock(), "requeued", reason="its kept pages block a resume",
                 num_pages=len(victim.page_ids))
      self._requeue(victim)
    return pool.can_swap_in(head.request_id, extra)

  def _admit_waiting(self, out: SchedulerOutput) -> None:
    """Moves waiting requests (FCFS) into the running set while budget and pages allow."""
    del out  # Admission never preempts: waiting requests take only free pages.
    if self.swapped:
      return  # Swapped requests resume first.
    pool = self.page_pool
    while self.waiting and len(self.running) < self.config.max_num_seqs and self._budget > 0:
      request = self.waiting[0]
      parent = request.parent
      if (parent is not None and pool.prefix is not None and not parent.output_ids
          and not parent.is_finished):
        return  # its sibling is computing the prompt it will read from the cache
      hits = self._cached_prefix(request)
      request.num_computed_tokens = len(hits) * pool.page_size  # computed by others
      num_new = self._num_new_prefill(request)
      total = request.num_computed_tokens + num_new
      if num_new == 0 or not pool.can_allocate(total, hits):
        request.num_computed_tokens = 0
        return  # Head-of-line blocking keeps FCFS order fair.
      self.waiting.popleft()
      self.admission.remove_backlog(request)
      request.page_ids = pool.allocate(request.request_id, total, hits)
      if pool.prefix is not None:
        pool.prefix.stats.query_tokens += request.num_tokens
        pool.prefix.stats.hit_tokens += request.num_computed_tokens
      request.status = _RUNNING
      self.running.append(request)
      request.log(self.clock(), "scheduled", num_computed_tokens=request.num_computed_tokens,
                  num_tokens=request.num_tokens)
      self._add(request, num_new)

  def _cached_prefix(self, request: Request) -> list[int]:
    """A waiting request's longest cached prefix, in whole pages, leaving at least its
    last token to compute (its logits sample the next token)."""
    pool = self.page_pool
    if pool.prefix is None or request.sampling.prompt_logprobs is not None:
      return []  # (prompt log-probabilities need the prompt's logits: all computed here)
    max_pages = (request.num_tokens - 1) // pool.page_size
    hashes = prefix_cache.request_hashes(request, max_pages * pool.page_size, pool.page_size)
    return pool.cached_prefix(hashes, max_pages)

  def _num_new_prefill(self, request: Request) -> int:
    """Tokens to compute next for a request joining the batch; 0 if they do not fit."""
    remaining = request.num_tokens - request.num_computed_tokens
    if self.config.prefill_policy == "none":
      return remaining if remaining <= self._budget else 0  # whole prompts only
    return min(remaining, self._budget, self._chunk_size)

  def _reserve_pages(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
    """Pages for `num_tokens` tokens, preempting others if needed; False if `request` lost."""
    pool = self.page_pool
    if len(request.page_ids) * pool.page_size >= num_tokens:
      return True
    while not pool.can_grow_to(request.request_id, num_tokens):
      victim = max(self.running, key=importance)
      self._preempt(victim, out)
      if victim is request:
        return False
    pool.grow_to(request.request_id, num_tokens)
    return True

  def _add(self, request: Request, num_new: int) -> None:
    self._scheduled[request.request_id] = make_sequence(request, num_new)
    self._budget -= num_new

  def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
    """Takes `victim` out of the running set by the configured mode (module docstring)."""
    self.running.remove(victim)
    dropped = self._scheduled.pop(victim.request_id, None)
    if dropped is not None:  # Already in this step's batch: give its tokens back.
      self._budget += len(dropped.token_ids)
    now = self.clock()
    mode = self.config.preemption_mode
    if mode == "swap" and not self.page_pool.can_swap_out(victim.request_id):
      victim.log(now, "swap_fallback", num_pages=len(victim.page_ids),
                 num_free_host_pages=self.page_pool.num_free_host_pages)
      mode = "recompute"
    victim.num_preemptions += 1
    victim.log(now, "preempted", mode=mode, num_computed_tokens=victim.num_computed_tokens)
    out.preempted.append(Preemption(victim, mode))
    self._preemptions[mode] += 1
    if mode == "swap":
      self._swap_out(victim, out, now)
    elif mode == "recompute":
      self._requeue(victim)
    else:
      self._finish(victim, "preempted", now)

  def _swap_out(self, victim: Request, out: SchedulerOutput, now: float) -> None:
    """Swap preemption: its pages go to the host pool; it resumes before any waiting one."""
    out.swap_out.extend(self.page_pool.swap_out(victim.request_id))
    victim.page_ids = self.page_pool.page_table(victim.request_id)  # shared pages it keeps
    victim.host_page_ids = self.page_pool.host_table(victim.request_id)
    victim.status = RequestStatus.SWAPPED
    victim.log(now, "swapped_out", num_pages=len(victim.host_page_ids))
    self.swapped.append(victim)
    self.admission.add_backlog(victim)

  def _requeue(self, victim: Request) -> None:
    """Recompute preemption: its pages are freed; it prefills prompt + output again."""
    self.page_pool.free(victim.request_id)
    victim.page_ids = []
    victim.num_computed_tokens = 0
    victim.status = RequestStatus.WAITING
    self.waiting.appendleft(victim)
    self.admission.add_backlog(victim)

  def _finish(self, request: Request, reason: str, now: float) -> None:
    """Ends a request in any queue: frees its pages, logs why, reports it once."""
    if request.status is _RUNNING and request in self.running:  # not if just preempted
      self.running.remove(request)
    elif request.status is RequestStatus.SWAPPED:
      self.swapped.remove(request)
    elif request.status is RequestStatus.WAITING and request in self.waiting:
      self.waiting.remove(request)
    self.admission.remove_backlog(request)
    self.page_pool.free(request.request_id)
    request.page_ids, request.host_page_ids = [], []
    request.num_pending = 0  # a token still in flight for it is void
    request.status, request.finish_reason = RequestStatus.FINISHED, reason
    request.log(now, "finished", reason=reason, num_output_tokens=request.num_output_tokens)
    if reason in ("length", "stop"):
      self.admission.record_output(request)
    self.requests.pop(request.request_id, None)
    self._num_finished += 1
    self._finished.append(request)


def importance(request: Request) -> tuple[int, float, int]:
  """Sort key: larger = less important = preempted first, resumed last."""
  # Only admitted requests are ranked, and `add_request` stamped their arrival time.
  return request.priority, cast(float, request.arrival_time), request.admission_index
